// The playground's wiring: the model list, a run (generate or score), its output, its numbers and its errors.

import { ApiError, call, callJson, events, storedKey, storeKey } from "./api.js";
import { completionBody, scoreBody } from "./form.js";
import { TokenNavigator, tokenSpans } from "./tokens.js";

const CONTEXT_CHARS = 400; // of the prompt, shown before generated text
const COUNT_DELAY_MS = 300; // typing pause before the prompt's tokens are counted

const $ = (id) => document.getElementById(id);
const ui = {
  model: $("model"),
  modelInfo: $("model-info"),
  keyBox: $("key-box"),
  key: $("api-key"),
  prompt: $("prompt"),
  count: $("prompt-count"),
  run: $("run"),
  stop: $("stop"),
  error: $("error"),
  output: $("output"),
  stats: $("stats"),
  request: $("request-json"),
  settings: $("settings"),
};
const tokens = new TokenNavigator(ui.output, $("popover"));
const cards = new Map(); // model id → its /v1/models card
let running = null; // the AbortController of the run in flight
let counting = 0; // the latest prompt count asked for; older answers are dropped

function start() {
  if (storedKey()) showKeyBox(storedKey());
  ui.run.addEventListener("click", run);
  ui.stop.addEventListener("click", () => running?.abort());
  document.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) {
      event.preventDefault();
      run();
    }
  });
  ui.key.addEventListener("change", () => {
    storeKey(ui.key.value.trim());
    clearError();
    loadModels();
  });
  ui.model.addEventListener("change", describeModel);
  let timer;
  ui.prompt.addEventListener("input", () => {
    clearTimeout(timer);
    timer = setTimeout(countPrompt, COUNT_DELAY_MS);
  });
  if (/Mac|iPhone|iPad/.test(navigator.platform)) ui.run.querySelector("kbd").textContent = "⌘ ↵";
  loadModels();
}

// --- the model ------------------------------------------------------------------------------------------------------
async function loadModels() {
  try {
    const { data } = await callJson("/v1/models");
    const previous = ui.model.value;
    cards.clear();
    ui.model.replaceChildren(
      ...data.map((card) => {
        cards.set(card.id, card);
        return new Option(card.id, card.id, false, card.id === previous);
      }),
    );
    await describeModel();
  } catch (error) {
    if (!cards.size) ui.model.replaceChildren(new Option("no models yet", ""));
    report(error);
  }
}

async function describeModel() {
  const model = ui.model.value;
  if (!model) return;
  const info = await callJson(`/tokenizer_info?model=${encodeURIComponent(model)}`).catch(() => null);
  const parts = [`context ${cards.get(model)?.max_model_len ?? "?"}`];
  if (info) parts.push(`vocabulary ${info.vocab_size.toLocaleString("en")}`);
  ui.modelInfo.textContent = parts.join(" · ");
  countPrompt();
}

async function countPrompt() {
  const asked = ++counting;
  const model = ui.model.value;
  if (!model) return;
  const result = await callJson("/tokenize", { body: { model, prompt: ui.prompt.value } }).catch(() => null);
  if (asked === counting && result) ui.count.textContent = `${result.count} tokens`;
}

// --- a run ----------------------------------------------------------------------------------------------------------
async function run() {
  if (running) return;
  const score = document.querySelector('input[name="mode"]:checked').value === "score";
  let body;
  try {
    if (!ui.model.value) throw new ApiError(0, "No model to ask yet: the model list has not loaded.", "model");
    const build = score ? scoreBody : completionBody;
    body = build(ui.settings, ui.model.value, ui.prompt.value);
  } catch (error) {
    report(error);
    return;
  }
  ui.request.textContent = JSON.stringify(body, null, 2);
  const output = new Output(ui.output, body, score);
  clearError();
  ui.stats.textContent = "";
  tokens.reset();
  setRunning(new AbortController());
  try {
    const response = await call("/v1/completions", { body, signal: running.signal });
    if (body.stream) {
      for await (const chunk of events(response)) output.add(chunk);
    } else {
      output.add(await response.json());
    }
    ui.stats.textContent = output.summary();
  } catch (error) {
    report(error);
  } finally {
    setRunning(null);
  }
}

function setRunning(controller) {
  running = controller;
  ui.run.disabled = Boolean(controller);
  ui.stop.disabled = !controller;
  ui.output.setAttribute("aria-busy", String(Boolean(controller)));
  if (!controller && document.activeElement === document.body) ui.run.focus();
}

// One run's output: a block per choice, filled as chunks arrive, and the run's timings.
class Output {
  constructor(target, body, score) {
    this.target = target;
    this.body = body;
    this.score = score;
    this.blocks = new Map(); // choice index → { text, finish }
    this.usage = null;
    this.logprobs = []; // every token logprob seen, for the score's totals
    this.started = performance.now();
    this.first = null;
    target.replaceChildren();
  }

  add(chunk) {
    for (const choice of chunk.choices ?? []) this.#choice(choice);
    if (chunk.usage) this.usage = chunk.usage;
  }

  #choice(choice) {
    const block = this.blocks.get(choice.index) ?? this.#block(choice.index);
    const logprobs = choice.logprobs;
    if (logprobs?.tokens?.length) {
      const spans = tokenSpans(logprobs);
      tokens.adopt(spans);
      block.text.append(...spans);
      this.logprobs.push(...logprobs.token_logprobs);
    } else if (choice.text) {
      block.text.append(choice.text);
    }
    if (this.first === null && (choice.text || logprobs?.tokens?.length)) this.first = performance.now();
    if (choice.finish_reason && !this.score) {
      const stop = choice.stop_reason == null ? "" : ` (${JSON.stringify(choice.stop_reason)})`;
      block.finish.textContent = `finish: ${choice.finish_reason}${stop}`;
    }
  }

  #block(index) {
    const article = document.createElement("article");
    article.className = "choice";
    const head = document.createElement("header");
    const name = document.createElement("span");
    name.textContent = this.score ? "prompt, scored" : `choice ${index}`;
    const finish = document.createElement("span");
    finish.className = "finish";
    head.append(name, finish);
    const text = document.createElement("div");
    text.className = "text";
    if (!this.score && !this.body.echo && typeof this.body.prompt === "string") {
      const context = document.createElement("span");
      context.className = "context";
      const prompt = this.body.prompt;
      context.textContent = prompt.length > CONTEXT_CHARS ? `…${prompt.slice(-CONTEXT_CHARS)}` : prompt;
      text.append(context);
    }
    article.append(head, text);
    const after = [...this.blocks.keys()].filter((i) => i > index).sort((a, b) => a - b)[0];
    this.target.insertBefore(article, after === undefined ? null : this.blocks.get(after).article);
    const block = { article, text, finish };
    this.blocks.set(index, block);
    return block;
  }

  summary() {
    const ended = performance.now();
    const parts = [];
    const use = this.usage;
    if (use) {
      parts.push(`${use.prompt_tokens} prompt tokens`);
      parts.push(`${use.prompt_tokens_details?.cached_tokens ?? 0} cached`);
      if (!this.score) parts.push(`${use.completion_tokens} generated`);
    }
    if (this.score) parts.push(...scoreTotals(this.logprobs));
    else parts.push(...this.#speed(ended, use));
    parts.push(`${Math.round(ended - this.started)} ms in all`);
    return parts.join(" · ");
  }

  #speed(ended, use) {
    const parts = [];
    if (this.body.stream && this.first !== null) {
      parts.push(`first token after ${Math.round(this.first - this.started)} ms`);
    }
    if (use?.completion_tokens) {
      // streamed: the pace after the first token (the prompt's prefill is in the time to it); else overall
      const since = this.body.stream && this.first !== null ? this.first : this.started;
      const later = this.body.stream ? use.completion_tokens - this.blocks.size : use.completion_tokens;
      const seconds = (ended - since) / 1000;
      if (later > 0 && seconds > 0) parts.push(`${(later / seconds).toFixed(1)} tokens/s`);
    }
    return parts;
  }
}

function scoreTotals(logprobs) {
  const known = logprobs.filter((lp) => lp !== null);
  if (!known.length) return [];
  const sum = known.reduce((a, b) => a + b, 0);
  const mean = sum / known.length;
  return [`logprob ${sum.toFixed(2)} (mean ${mean.toFixed(3)})`, `perplexity ${Math.exp(-mean).toFixed(2)}`];
}

// --- errors ---------------------------------------------------------------------------------------------------------
function report(error) {
  if (error?.name === "AbortError") {
    ui.stats.textContent = "Stopped.";
    return;
  }
  const known = error instanceof ApiError;
  let message = known ? error.message : `Could not reach the server: ${error?.message ?? error}`;
  if (known && error.status === 401) {
    message += " Enter the key above: it is kept for this tab only.";
    showKeyBox(ui.key.value);
    ui.key.focus();
  }
  const title = document.createElement("strong");
  title.textContent = known && error.status ? `Error ${error.status}` : "Error";
  const about = known ? error.param ?? error.code : null;
  const where = about ? ` (${about})` : "";
  ui.error.replaceChildren(title, `${where}: ${message}`);
  ui.error.hidden = false;
}

function clearError() {
  ui.error.hidden = true;
  ui.error.replaceChildren();
}

function showKeyBox(value) {
  ui.keyBox.hidden = false;
  ui.key.value = value;
}

start();
