// The settings form → a /v1/completions body. Every input names its field (data-field) and how to read it
// (data-kind); a blank input is not sent, so the server's own default applies. Values are not range-checked here:
// the server is the one judge, and its 400 names the field.

import { ApiError } from "./api.js";

const READERS = {
  int: (input) => Number.parseInt(input.value, 10),
  float: (input) => Number(input.value),
  text: (input) => input.value,
  lines: (input) => lines(input.value).map(unescape),
  ints: (input) => ids(input),
  json: (input) => json(input.value, input.dataset.field),
};

export function completionBody(form, model, prompt) {
  const body = { model, prompt };
  for (const input of form.querySelectorAll("[data-field]")) {
    const value = read(input);
    if (value !== undefined) body[input.dataset.field] = value;
  }
  Object.assign(body, constraint(form));
  const extra = form.querySelector("#extra").value;
  if (extra.trim()) {
    const fields = json(extra, "extra fields");
    if (!fields || typeof fields !== "object" || Array.isArray(fields)) {
      throw new ApiError(0, "The extra fields must be a JSON object.", "extra fields");
    }
    Object.assign(body, fields);
  }
  if (body.stream && body.stream_options === undefined) {
    body.stream_options = { include_usage: true }; // usage and cached tokens come in a last chunk
  }
  return body;
}

// Score mode: the prompt's own tokens with their logprobs, and nothing generated.
export function scoreBody(form, model, prompt) {
  const logprobs = read(form.querySelector('[data-field="logprobs"]'));
  return { model, prompt, echo: true, max_tokens: 0, logprobs: logprobs ?? 5 };
}

function read(input) {
  if (input.dataset.kind === "bool") {
    // sent only when it differs from the server's default, so an untouched box adds nothing to the body
    return input.checked === (input.dataset.serverDefault === "true") ? undefined : input.checked;
  }
  if (!input.value.trim()) return undefined;
  const value = READERS[input.dataset.kind](input);
  if (typeof value === "number" && Number.isNaN(value)) {
    throw new ApiError(0, `'${input.dataset.field}' must be a number.`, input.dataset.field);
  }
  return value;
}

function constraint(form) {
  const kind = form.querySelector("#constraint-kind").value;
  const text = form.querySelector("#constraint").value;
  const field = kind.startsWith("json_") ? "response_format" : "structured_outputs";
  switch (kind) {
    case "":
      return {};
    case "json":
      return { [field]: { json: text.trim() ? json(text, field) : true } };
    case "choice":
      return { [field]: { choice: lines(text) } };
    case "json_object":
      return { [field]: { type: "json_object" } };
    case "json_schema":
      return { [field]: { type: "json_schema", json_schema: { name: "schema", schema: json(text, field) } } };
    default: // regex, grammar: the text as it is
      return { [field]: { [kind]: text } };
  }
}

function lines(text) {
  return text.split(/\r?\n/).filter((line) => line !== "");
}

function unescape(line) {
  return line.replace(/\\(n|t|\\)/g, (_, c) => ({ n: "\n", t: "\t", "\\": "\\" })[c]);
}

function ids(input) {
  const parts = input.value.split(/[\s,]+/).filter(Boolean);
  if (!parts.every((part) => /^\d+$/.test(part))) {
    throw new ApiError(0, `'${input.dataset.field}' takes token ids: integers separated by commas.`, input.dataset.field);
  }
  return parts.map(Number);
}

function json(text, field) {
  try {
    return JSON.parse(text);
  } catch (error) {
    throw new ApiError(0, `'${field}' is not valid JSON: ${error.message}`, field);
  }
}
