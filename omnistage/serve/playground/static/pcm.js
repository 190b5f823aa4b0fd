// 16-bit little-endian mono PCM: decoding a byte stream to samples, and packing a WAV file.

const BYTES_PER_SAMPLE = 2;
const WAV_HEADER_BYTES = 44;

/**
 * Decodes s16le bytes to Float32 samples in [-1, 1) as they arrive. Network chunks may
 * split a sample between them: an odd trailing byte is held back and joined to the next
 * chunk, so no sample is lost or misaligned.
 */
export class S16Decoder {
  #carry = null; // the first byte of a sample whose second byte has not arrived yet

  /** @param {Uint8Array} bytes @returns {Float32Array} the complete samples so far */
  decode(bytes) {
    const joined = this.#joinCarry(bytes);
    const usable = joined.length - (joined.length % BYTES_PER_SAMPLE);
    this.#carry = usable < joined.length ? joined[usable] : null;
    return s16ToFloat32(joined, usable);
  }

  /** Bytes held back (0 or 1); non-zero at the end means the stream was cut mid-sample. */
  get pendingBytes() {
    return this.#carry === null ? 0 : 1;
  }

  #joinCarry(bytes) {
    if (this.#carry === null) return bytes;
    const joined = new Uint8Array(bytes.length + 1);
    joined[0] = this.#carry;
    joined.set(bytes, 1);
    return joined;
  }
}

function s16ToFloat32(bytes, length) {
  const view = new DataView(bytes.buffer, bytes.byteOffset, length);
  const samples = new Float32Array(length / BYTES_PER_SAMPLE);
  for (let i = 0; i < samples.length; i++) {
    samples[i] = view.getInt16(i * BYTES_PER_SAMPLE, true) / 32768;
  }
  return samples;
}

/** Joins byte chunks into one array cut to a whole number of samples. */
export function joinSamples(chunks) {
  const total = chunks.reduce((n, chunk) => n + chunk.length, 0);
  const joined = new Uint8Array(total - (total % BYTES_PER_SAMPLE));
  let offset = 0;
  for (const chunk of chunks) {
    const part = chunk.subarray(0, joined.length - offset);
    joined.set(part, offset);
    offset += part.length;
  }
  return joined;
}

/** A mono 16-bit PCM WAV file of the s16le byte `chunks` at `sampleRate` Hz. */
export function wavBlob(chunks, sampleRate) {
  const data = joinSamples(chunks);
  return new Blob([wavHeader(data.length, sampleRate), data], { type: "audio/wav" });
}

/** The 44-byte RIFF/WAVE header of `dataBytes` bytes of mono s16le audio. */
export function wavHeader(dataBytes, sampleRate) {
  const header = new DataView(new ArrayBuffer(WAV_HEADER_BYTES));
  const text = (offset, s) => [...s].forEach((c, i) => header.setUint8(offset + i, c.charCodeAt(0)));
  text(0, "RIFF");
  header.setUint32(4, WAV_HEADER_BYTES - 8 + dataBytes, true);
  text(8, "WAVE");
  text(12, "fmt ");
  header.setUint32(16, 16, true); // fmt chunk size
  header.setUint16(20, 1, true); // PCM
  header.setUint16(22, 1, true); // mono
  header.setUint32(24, sampleRate, true);
  header.setUint32(28, sampleRate * BYTES_PER_SAMPLE, true); // byte rate
  header.setUint16(32, BYTES_PER_SAMPLE, true); // block align
  header.setUint16(34, 16, true); // bits per sample
  text(36, "data");
  header.setUint32(40, dataBytes, true);
  return header.buffer;
}
