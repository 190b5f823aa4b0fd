// The playground page: wires the form, the buttons and the status display together.
//
// `window.playground` is a read-only view of the page's status, for people and tests:
// state ("loading" | "idle" | "requesting" | "receiving" | "playing" | "done" | "stopped"
// | "error"), kind ("speech" | "chat": the served model's tab), model, voices, sampleRate,
// samplesReceived, samplesScheduled, ttfaMs, audioSeconds, wallMs, rtf, underruns, error;
// for chat also reply (the text so far), ttftMs, finishReason, usage.

import { fetchVoices } from "./api.js";
import { ChatRun, PCM16_RATE, isChatModel, readChatRequest, renderChatForm } from "./chat.js";
import { readRequest, renderForm } from "./form.js";
import { wavBlob } from "./pcm.js";
import { SpeechRun } from "./run.js";

const $ = (id) => document.getElementById(id);
const BUSY = new Set(["requesting", "receiving", "playing"]);
const FRESH_RUN = {
  samplesReceived: 0, samplesScheduled: 0, ttfaMs: null, audioSeconds: null,
  wallMs: null, rtf: null, underruns: 0, error: null,
  reply: "", ttftMs: null, finishReason: null, usage: null,
};

const status = { state: "loading", kind: null, model: null, voices: [], sampleRate: null, ...FRESH_RUN };
let info = null; // the last GET /v1/audio/voices answer
let current = null; // the SpeechRun of the last Play, or the ChatRun of the last Send
let context = null; // the AudioContext, created on the first Play

function exposeStatus() {
  const view = {};
  for (const key of Object.keys(status)) {
    Object.defineProperty(view, key, { get: () => status[key], enumerable: true });
  }
  Object.defineProperty(window, "playground", { value: Object.freeze(view), enumerable: true });
}

function update(changes) {
  Object.assign(status, changes);
  render();
}

function formatted(value, digits, unit) {
  return value === null || value === undefined ? "–" : `${value.toFixed(digits)}${unit}`;
}

function render() {
  $("state").textContent = status.state;
  $("ttft").textContent = formatted(status.ttftMs, 0, " ms");
  $("ttfa").textContent = formatted(status.ttfaMs, 0, " ms");
  $("chat-reply").textContent = status.reply;
  $("duration").textContent = formatted(status.audioSeconds, 2, " s");
  $("rtf").textContent = formatted(status.rtf, 3, "");
  $("error").hidden = !status.error;
  $("error").textContent = status.error || "";
  const busy = BUSY.has(status.state);
  $("play").disabled = busy || !info;
  $("stop").disabled = !busy;
  $("download").disabled = busy || !current || current.samplesReceived === 0;
  $("chat-send").disabled = busy || !info;
  $("chat-stop").disabled = !busy;
}

function errorText(error) {
  return error.status ? `${error.message} (HTTP ${error.status})` : error.message;
}

function apiKey() {
  return $("api-key").value.trim();
}

function describeModel(voices) {
  const languages = voices.languages.length ? `, languages ${voices.languages.join(", ")}` : "";
  return `${voices.model} (${voices.model_type}), ${voices.sample_rate} Hz${languages}`;
}

async function loadVoices() {
  if (current) current.stop();
  info = null;
  update({ state: "loading", error: null });
  try {
    info = await fetchVoices(apiKey());
  } catch (error) {
    $("model-info").textContent = error.status === 401 ? "enter the server's API key, then Load voices" : "";
    update({ state: "error", error: errorText(error) });
    return;
  }
  const chat = isChatModel(info);
  showTab(chat ? "chat" : "speech");
  if (chat) {
    renderChatForm(info);
    const speaks = info.audio_output ? `, speaks at ${info.sample_rate} Hz` : ", text only";
    $("model-info").textContent = `${info.model} (${info.model_type}), chat${speaks}; takes ${info.input_modalities.join(", ")}`;
  } else {
    renderForm(info);
    $("model-info").textContent = describeModel(info);
  }
  const kind = chat ? "chat" : "speech";
  update({ state: "idle", kind, model: info.model, voices: [...info.voices], sampleRate: info.sample_rate });
}

/** Show the tab of the served model's kind (a server serves one model: the other tab is off). */
function showTab(kind) {
  for (const name of ["speech", "chat"]) {
    $(`tab-${name}`).setAttribute("aria-pressed", String(name === kind));
    $(`tab-${name}`).title = name === kind ? "" : `the served model is a ${kind} model`;
  }
  $("speech-form").hidden = kind !== "speech";
  $("chat-form").hidden = kind !== "chat";
  $("ttft-stat").hidden = kind !== "chat";
}

/** The AudioContext, at the model's rate when the browser allows (no resampling per piece). */
function audioContext(sampleRate) {
  if (context && context.sampleRate === sampleRate) return context;
  if (context) context.close();
  try {
    context = new AudioContext({ sampleRate });
  } catch {
    context = new AudioContext();
  }
  return context;
}

async function play(event) {
  event.preventDefault();
  if (!info || BUSY.has(status.state)) return;
  const run = new SpeechRun(audioContext(info.sample_rate), info.sample_rate, (changes) => {
    if (current === run) update(changes);
  });
  current = run;
  update({ ...FRESH_RUN, state: "requesting" });
  try {
    await run.context.resume();
    await run.run(await readRequest(info), apiKey());
    if (!run.stopped) update({ state: "done" });
  } catch (error) {
    if (run.stopped) return; // Stop (or Load voices) already set the state
    run.stop(); // a stream that broke off: silence what was scheduled of it
    update({ state: "error", error: errorText(error) });
  }
}

async function send(event) {
  event.preventDefault();
  if (!info || BUSY.has(status.state)) return;
  const run = new ChatRun(audioContext(PCM16_RATE), (changes) => {
    if (current === run) update(changes);
  });
  current = run;
  update({ ...FRESH_RUN, state: "requesting" });
  try {
    await run.context.resume();
    await run.run(await readChatRequest(info), apiKey());
    if (!run.stopped) update({ state: "done" });
  } catch (error) {
    if (run.stopped) return;
    run.stop();
    update({ state: "error", error: errorText(error) });
  }
}

function stop() {
  if (!current || !BUSY.has(status.state)) return;
  current.stop();
  update({ state: "stopped" });
}

function download() {
  if (!current || current.samplesReceived === 0) return;
  const url = URL.createObjectURL(wavBlob(current.chunks, current.sampleRate));
  const link = document.createElement("a");
  Object.assign(link, { href: url, download: "omnistage-speech.wav" });
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 60_000);
}

function wire() {
  $("speech-form").addEventListener("submit", play);
  $("stop").addEventListener("click", stop);
  $("chat-form").addEventListener("submit", send);
  $("chat-stop").addEventListener("click", stop);
  $("download").addEventListener("click", download);
  $("auth").addEventListener("submit", (event) => {
    event.preventDefault();
    loadVoices();
  });
}

exposeStatus();
wire();
render();
loadVoices();
