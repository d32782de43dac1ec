// Talking to the server: the API key, OpenAI's error body, and the SSE stream of /v1/completions read by hand
// (EventSource cannot POST or send an Authorization header).

const KEY_STORAGE = "tokenmill.apiKey"; // sessionStorage: the key lives as long as this tab, never on disk for good

export class ApiError extends Error {
  // status 0: no HTTP answer (network, aborted, a body that is not ours)
  constructor(status, message, param = null, code = null) {
    super(message);
    this.status = status;
    this.param = param;
    this.code = code;
  }

  static fromBody(status, body) {
    const error = body && typeof body === "object" ? body.error : null;
    if (error && typeof error.message === "string") {
      return new ApiError(status, error.message, error.param ?? null, error.code ?? null);
    }
    return new ApiError(status, `The server answered ${status} without an error message.`);
  }
}

export function storedKey() {
  return sessionStorage.getItem(KEY_STORAGE) || "";
}

export function storeKey(key) {
  if (key) sessionStorage.setItem(KEY_STORAGE, key);
  else sessionStorage.removeItem(KEY_STORAGE);
}

// fetch with the key; a non-2xx answer becomes an ApiError carrying the server's message.
export async function call(path, { body, signal } = {}) {
  const headers = {};
  const key = storedKey();
  if (key) headers.Authorization = `Bearer ${key}`;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const init = { method: body === undefined ? "GET" : "POST", headers, signal };
  if (body !== undefined) init.body = JSON.stringify(body);
  const response = await fetch(path, init);
  if (!response.ok) {
    const parsed = await response.json().catch(() => null);
    throw ApiError.fromBody(response.status, parsed);
  }
  return response;
}

export async function callJson(path, options) {
  return (await call(path, options)).json();
}

// Each `data:` payload of an SSE body, parsed; ends at [DONE]. An error frame (the server's failure after the 200
// went out) is thrown as an ApiError; a stream that ends without [DONE] was cut off, which is an error too.
export async function* events(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      for (let end = frameEnd(buffer); end; end = frameEnd(buffer)) {
        const data = frameData(buffer.slice(0, end.index));
        buffer = buffer.slice(end.index + end[0].length);
        if (data === null) continue;
        if (data === "[DONE]") return;
        const payload = JSON.parse(data);
        if (payload && payload.error) throw ApiError.fromBody(0, payload); // 0: the HTTP status was a 200
        yield payload;
      }
    }
  } finally {
    reader.cancel().catch(() => {}); // left early (an error frame, Stop): close the connection, freeing the server
  }
  throw new ApiError(0, "The stream ended before [DONE]: the connection was cut.");
}

function frameEnd(buffer) {
  return /\r\n\r\n|\n\n|\r\r/.exec(buffer);
}

// The joined `data:` lines of one frame (SSE: one optional space after the colon); null for a frame without data.
function frameData(frame) {
  const lines = frame.split(/\r\n|\n|\r/).filter((line) => line.startsWith("data:"));
  if (!lines.length) return null;
  return lines.map((line) => line.slice(line.startsWith("data: ") ? 6 : 5)).join("\n");
}
