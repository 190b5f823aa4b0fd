// The server's /v1 API, from the page. URLs are relative to the page (proxy prefixes work).

/** A non-2xx answer: `message` is the server's error.message (OpenAI error envelope). */
export class ApiError extends Error {
  constructor(message, status) {
    super(message);
    this.name = "ApiError";
    this.status = status;
  }
}

function headers(apiKey, json) {
  const result = {};
  if (apiKey) result.Authorization = `Bearer ${apiKey}`;
  if (json) result["Content-Type"] = "application/json";
  return result;
}

/** The ApiError for a failed `response`, with the server's message when it sent one. */
export async function apiError(response) {
  let message = `${response.status} ${response.statusText}`.trim();
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) message = body.error.message;
  } catch {
    // not a JSON error envelope: keep the status line
  }
  return new ApiError(message, response.status);
}

async function checked(response) {
  if (!response.ok) throw await apiError(response);
  return response;
}

/** GET /v1/audio/voices: the served model's voices, languages, fields and sample rate. */
export async function fetchVoices(apiKey) {
  const response = await fetch("v1/audio/voices", { headers: headers(apiKey, false) });
  return (await checked(response)).json();
}

/** POST /v1/audio/speech; resolves once the headers are in (the body is still streaming). */
export async function postSpeech(body, apiKey, signal) {
  const response = await fetch("v1/audio/speech", {
    method: "POST",
    headers: headers(apiKey, true),
    body: JSON.stringify(body),
    signal,
  });
  return checked(response);
}

/** POST /v1/chat/completions (streamed); resolves once the headers are in. */
export async function postChat(body, apiKey, signal) {
  const response = await fetch("v1/chat/completions", {
    method: "POST",
    headers: headers(apiKey, true),
    body: JSON.stringify(body),
    signal,
  });
  return checked(response);
}
