// Gapless playback of audio that arrives in pieces, on the AudioContext clock.

export const LEAD_S = 0.05; // headroom before the first piece (and after an underrun)
const MIN_AHEAD_S = 0.01; // a piece due sooner than this would start late: re-anchor

/**
 * Schedules each piece as an AudioBufferSourceNode starting exactly where the previous one
 * ends. Start times come from one frame-aligned anchor plus the count of samples already
 * scheduled (`nextStartTime`), never from summed durations, so there is no drift, gap or
 * overlap between pieces. When pieces arrive slower than real time and the next start is
 * already (nearly) past, the anchor moves to now + LEAD_S and `underruns` counts it.
 */
export class StreamPlayer {
  #anchorFrame = null; // the frame (at sampleRate) at which sample 0 plays
  #sources = new Set();

  /** @param {BaseAudioContext} context @param {number} sampleRate of the pieces, Hz */
  constructor(context, sampleRate) {
    this.context = context;
    this.sampleRate = sampleRate;
    this.samplesScheduled = 0;
    this.underruns = 0;
    this.onidle = null; // called when the last scheduled piece has finished playing
  }

  /** Context time at which the next piece will start (null before the first). */
  get nextStartTime() {
    if (this.#anchorFrame === null) return null;
    return (this.#anchorFrame + this.samplesScheduled) / this.sampleRate;
  }

  /** True while a scheduled piece has not finished playing. */
  get playing() {
    return this.#sources.size > 0;
  }

  /** Play `samples` (Float32Array, mono) right after everything scheduled before. */
  schedule(samples) {
    if (samples.length === 0) return;
    const source = this.#sourceFor(samples);
    source.start(this.#startTime());
    this.#sources.add(source);
    this.samplesScheduled += samples.length;
  }

  /** Stop all playback now; pieces scheduled later are not played. */
  stop() {
    for (const source of this.#sources) {
      source.onended = null;
      source.stop();
    }
    this.#sources.clear();
  }

  #sourceFor(samples) {
    const buffer = this.context.createBuffer(1, samples.length, this.sampleRate);
    buffer.copyToChannel(samples, 0);
    const source = this.context.createBufferSource();
    source.buffer = buffer;
    source.connect(this.context.destination);
    source.onended = () => this.#ended(source);
    return source;
  }

  #startTime() {
    const now = this.context.currentTime;
    if (this.#anchorFrame === null || this.nextStartTime < now + MIN_AHEAD_S) {
      if (this.#anchorFrame !== null) this.underruns += 1;
      const frame = Math.ceil((now + LEAD_S) * this.sampleRate);
      this.#anchorFrame = frame - this.samplesScheduled;
    }
    return this.nextStartTime;
  }

  #ended(source) {
    this.#sources.delete(source);
    if (this.#sources.size === 0 && this.onidle) this.onidle();
  }
}
