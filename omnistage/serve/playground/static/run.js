// One press of Play: request, receive, decode, play, measure.

import { postSpeech } from "./api.js";
import { S16Decoder } from "./pcm.js";
import { StreamPlayer } from "./player.js";

function concatSamples(parts) {
  const joined = new Float32Array(parts.reduce((n, part) => n + part.length, 0));
  let offset = 0;
  for (const part of parts) {
    joined.set(part, offset);
    offset += part.length;
  }
  return joined;
}

/**
 * POSTs the request and reads the raw s16le body with a stream reader. Streaming: each
 * piece is decoded and scheduled as it arrives. Not streaming: all of it is played once
 * received. `report(changes)` receives progress (state, sample counts, TTFA, duration,
 * RTF); `run()` resolves when playback has ended. `stop()` aborts the fetch (the server
 * sees the disconnect) and silences playback.
 */
export class SpeechRun {
  #decoder = new S16Decoder();
  #controller = new AbortController();
  #held = []; // decoded samples kept until the end (not streaming)
  #ended = null; // resolves when playback has ended or was stopped
  #endPlayback = () => {};

  constructor(context, sampleRate, report) {
    this.context = context;
    this.sampleRate = sampleRate; // replaced by the response's X-Sample-Rate
    this.report = report;
    this.chunks = []; // the bytes as received, for the WAV download
    this.samplesReceived = 0;
    this.player = null;
    this.stopped = false;
  }

  /** Speak `body` (a speech request for raw pcm); resolves when playback has ended. */
  async run(body, apiKey) {
    this.sentAt = performance.now();
    this.report({ state: "requesting" });
    const response = await postSpeech(body, apiKey, this.#controller.signal);
    this.#startPlayer(response);
    await this.#receive(response.body.getReader(), Boolean(body.stream));
    this.#received();
    await this.#ended;
  }

  /** Abort the request and stop playback at once. */
  stop() {
    this.stopped = true;
    this.#controller.abort();
    if (this.player) this.player.stop();
    this.#endPlayback();
  }

  #startPlayer(response) {
    const rate = Number(response.headers.get("X-Sample-Rate"));
    if (Number.isInteger(rate) && rate > 0) this.sampleRate = rate;
    this.player = new StreamPlayer(this.context, this.sampleRate);
    this.#ended = new Promise((resolve) => (this.#endPlayback = resolve));
    this.report({ state: "receiving", sampleRate: this.sampleRate });
  }

  async #receive(reader, streaming) {
    for (;;) {
      const { done, value } = await this.#read(reader);
      if (done) return;
      if (value.length) this.#take(value, streaming);
    }
  }

  async #read(reader) {
    try {
      return await reader.read();
    } catch (error) {
      if (this.stopped) throw error;
      const seconds = (this.samplesReceived / this.sampleRate).toFixed(2);
      throw new Error(`the audio stream broke off after ${seconds} s (${error.message}); see the server log`);
    }
  }

  #take(bytes, streaming) {
    if (this.chunks.length === 0) this.report({ ttfaMs: performance.now() - this.sentAt });
    this.chunks.push(bytes);
    const samples = this.#decoder.decode(bytes);
    this.samplesReceived += samples.length;
    if (streaming) this.player.schedule(samples);
    else this.#held.push(samples);
    this.#reportProgress();
  }

  #received() {
    const wallMs = performance.now() - this.sentAt;
    this.player.schedule(concatSamples(this.#held));
    this.#held = [];
    this.#reportProgress();
    const audioSeconds = this.samplesReceived / this.sampleRate;
    this.report({ state: "playing", wallMs, rtf: audioSeconds > 0 ? wallMs / 1000 / audioSeconds : null });
    this.player.onidle = () => this.#endPlayback();
    if (!this.player.playing) this.#endPlayback();
  }

  #reportProgress() {
    this.report({
      samplesReceived: this.samplesReceived,
      samplesScheduled: this.player.samplesScheduled,
      audioSeconds: this.samplesReceived / this.sampleRate,
      underruns: this.player.underruns,
    });
  }
}
