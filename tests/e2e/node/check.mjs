// The official `openai` Node package against a running tokenmill: a completion, a stream and an echo+logprobs scoring
// request. Asserts what it can on its own, prints the results as one JSON line for the Python side to compare with
// the Python client, and exits non-zero on any failure. Usage: TOKENMILL_BASE_URL=http://127.0.0.1:8000 node check.mjs
import assert from "node:assert/strict";
import OpenAI from "openai";

const baseURL = `${process.env.TOKENMILL_BASE_URL ?? "http://127.0.0.1:8000"}/v1`;
const model = process.env.TOKENMILL_MODEL ?? "gemma-3-270m";
const prompt = "The capital of France is";
const client = new OpenAI({ baseURL, apiKey: "unused", maxRetries: 0, timeout: 120_000 });

async function completion() {
  const r = await client.completions.create({ model, prompt, max_tokens: 12, temperature: 0 });
  assert.equal(r.object, "text_completion");
  assert.equal(r.model, model);
  assert.ok(r.id.startsWith("cmpl-") && r.system_fingerprint, "id and system_fingerprint");
  assert.equal(r.choices.length, 1);
  assert.equal(r.choices[0].finish_reason, "length");
  assert.equal(r.usage.completion_tokens, 12);
  assert.equal(r.usage.total_tokens, r.usage.prompt_tokens + 12);
  return r;
}

async function stream() {
  const chunks = await client.completions.create({
    model, prompt, max_tokens: 12, temperature: 0, stream: true, stream_options: { include_usage: true },
  });
  let text = "";
  const finishes = [];
  const ids = new Set();
  let usage = null;
  for await (const chunk of chunks) {
    ids.add(chunk.id);
    for (const c of chunk.choices) {
      assert.equal(c.index, 0);
      text += c.text;
      if (c.finish_reason !== null) finishes.push(c.finish_reason);
    }
    if (chunk.usage) usage = chunk.usage;
  }
  assert.deepEqual(finishes, ["length"], "exactly one finish_reason");
  assert.equal(ids.size, 1, "one id for the whole stream");
  assert.ok(usage && usage.completion_tokens === 12, "usage chunk");
  return text;
}

async function echoScoring() {
  const r = await client.completions.create({ model, prompt, max_tokens: 0, echo: true, logprobs: 1 });
  const choice = r.choices[0];
  const lp = choice.logprobs;
  assert.equal(choice.text, prompt);
  const n = lp.tokens.length;
  assert.ok(n >= 2 && [lp.token_logprobs, lp.top_logprobs, lp.text_offset].every((a) => a.length === n));
  assert.equal(lp.token_logprobs[0], null);
  for (let i = 1; i < n; i++) {
    assert.ok(Number.isFinite(lp.token_logprobs[i]) && lp.token_logprobs[i] <= 0, `logprob ${i}`);
    assert.ok(lp.tokens[i] in lp.top_logprobs[i], `top_logprobs ${i} holds the token`);
    assert.ok(lp.text_offset[i] >= lp.text_offset[i - 1], "text_offset never goes back");
  }
  return lp;
}

async function unknownModel() {
  await assert.rejects(
    client.completions.create({ model: "no-such-model", prompt: "x" }),
    (e) => e instanceof OpenAI.NotFoundError && e.status === 404 && e.error?.param === "model",
  );
}

try {
  const full = await completion();
  const streamed = await stream();
  assert.equal(streamed, full.choices[0].text, "joined stream equals the non-streamed text");
  const lp = await echoScoring();
  await unknownModel();
  console.log(JSON.stringify({ text: full.choices[0].text, streamed, tokens: lp.tokens, token_logprobs: lp.token_logprobs }));
} catch (err) {
  console.error(err);
  process.exit(1);
}
