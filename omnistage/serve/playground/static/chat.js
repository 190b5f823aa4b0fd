// The chat tab: one message (text, an image, an audio clip) to POST /v1/chat/completions,
// streamed; the reply text grows as its deltas arrive and its spoken audio (pcm16 deltas)
// plays as it streams.

import { postChat } from "./api.js";
import { readFile } from "./form.js";
import { S16Decoder } from "./pcm.js";
import { StreamPlayer } from "./player.js";

const $ = (id) => document.getElementById(id);
export const PCM16_RATE = 24000; // OpenAI's pcm16: 24 kHz s16le mono

/** Whether GET /v1/audio/voices describes a chat model (it lists its input kinds). */
export function isChatModel(info) {
  return Array.isArray(info.input_modalities);
}

/** Shape the chat form for the model: voices (or text only), which attachments it takes. */
export function renderChatForm(info) {
  const select = $("chat-voice");
  select.replaceChildren(new Option("text only", ""));
  for (const voice of info.voices) select.append(new Option(voice, voice));
  if (info.voices.length) select.value = info.voices[0];
  $("chat-voice-field").hidden = !info.audio_output;
  $("chat-image-field").hidden = !info.input_modalities.includes("image");
  $("chat-audio-field").hidden = !info.input_modalities.includes("audio");
}

function base64Of(dataUri) {
  return dataUri.slice(dataUri.indexOf(",") + 1);
}

function audioFormat(file) {
  const extension = file.name.includes(".") ? file.name.split(".").pop().toLowerCase() : "";
  return extension || file.type.split("/").pop() || "wav";
}

/** The streamed chat request for the form's values. */
export async function readChatRequest(info) {
  const content = [{ type: "text", text: $("chat-text").value }];
  const image = $("chat-image-field").hidden ? undefined : $("chat-image").files[0];
  if (image) content.push({ type: "image_url", image_url: { url: await readFile(image) } });
  const clip = $("chat-audio-field").hidden ? undefined : $("chat-audio").files[0];
  if (clip) {
    content.push({ type: "input_audio", input_audio: { data: base64Of(await readFile(clip)), format: audioFormat(clip) } });
  }
  const body = {
    model: info.model,
    messages: [{ role: "user", content }],
    stream: true,
    stream_options: { include_usage: true },
  };
  const maxTokens = $("chat-max-tokens").value.trim();
  if (maxTokens) body.max_tokens = Number(maxTokens);
  const voice = $("chat-voice-field").hidden ? "" : $("chat-voice").value;
  if (voice) Object.assign(body, { modalities: ["text", "audio"], audio: { voice, format: "pcm16" } });
  return body;
}

function bytesOf(base64) {
  const text = atob(base64);
  const bytes = new Uint8Array(text.length);
  for (let i = 0; i < text.length; i++) bytes[i] = text.charCodeAt(i);
  return bytes;
}

/**
 * One press of Send: reads the server-sent events, appends `delta.content` to `reply`,
 * decodes and schedules each `delta.audio.data` piece at once. `report(changes)` receives
 * progress (state, reply, TTFT, TTFA, sample counts, finish reason); `run()` resolves when
 * the reply is complete and its audio has played. `stop()` aborts the fetch (the server
 * sees the disconnect) and silences playback.
 */
export class ChatRun {
  #controller = new AbortController();
  #decoder = new S16Decoder();
  #ended = null;
  #endPlayback = () => {};

  constructor(context, report) {
    this.context = context;
    this.report = report;
    this.reply = "";
    this.chunks = [];
    this.samplesReceived = 0;
    this.player = new StreamPlayer(context, PCM16_RATE);
    this.stopped = false;
  }

  async run(body, apiKey) {
    this.sentAt = performance.now();
    this.report({ state: "requesting" });
    const response = await postChat(body, apiKey, this.#controller.signal);
    this.#ended = new Promise((resolve) => (this.#endPlayback = resolve));
    this.report({ state: "receiving", sampleRate: PCM16_RATE });
    await this.#receive(response.body.pipeThrough(new TextDecoderStream()).getReader());
    const wallMs = performance.now() - this.sentAt;
    this.report({ state: "playing", wallMs });
    this.player.onidle = () => this.#endPlayback();
    if (!this.player.playing) this.#endPlayback();
    await this.#ended;
  }

  stop() {
    this.stopped = true;
    this.#controller.abort();
    this.player.stop();
    this.#endPlayback();
  }

  async #receive(reader) {
    let pending = "";
    for (;;) {
      const { done, value } = await reader.read();
      if (done) throw new Error("the reply broke off before its end; see the server log");
      pending += value;
      let end;
      while ((end = pending.indexOf("\n\n")) >= 0) {
        const event = pending.slice(0, end);
        pending = pending.slice(end + 2);
        if (this.#take(event)) return;
      }
    }
  }

  /** One event; true at `data: [DONE]`. */
  #take(event) {
    const data = event.split("\n").filter((line) => line.startsWith("data: ")).map((line) => line.slice(6)).join("");
    if (data === "[DONE]") return true;
    const chunk = JSON.parse(data);
    if (chunk.error) throw new Error(chunk.error.message);
    if (chunk.usage) this.report({ usage: chunk.usage });
    const choice = chunk.choices && chunk.choices[0];
    if (!choice) return false;
    const { content, audio } = choice.delta;
    if (content) {
      if (!this.reply) this.report({ ttftMs: performance.now() - this.sentAt });
      this.reply += content;
      this.report({ reply: this.reply });
    }
    if (audio && audio.data) this.#play(bytesOf(audio.data));
    if (choice.finish_reason) this.report({ finishReason: choice.finish_reason });
    return false;
  }

  #play(bytes) {
    if (this.chunks.length === 0) this.report({ ttfaMs: performance.now() - this.sentAt });
    this.chunks.push(bytes);
    const samples = this.#decoder.decode(bytes);
    this.samplesReceived += samples.length;
    this.player.schedule(samples);
    this.report({
      samplesReceived: this.samplesReceived,
      samplesScheduled: this.player.samplesScheduled,
      audioSeconds: this.samplesReceived / PCM16_RATE,
      underruns: this.player.underruns,
    });
  }
}
