// The request form: shaped by GET /v1/audio/voices, read into a POST /v1/audio/speech body.

const $ = (id) => document.getElementById(id);

function show(id, visible) {
  $(id).hidden = !visible;
}

function fillSelect(select, values, selected, blankLabel) {
  select.replaceChildren();
  if (blankLabel) select.append(new Option(blankLabel, ""));
  for (const value of values) select.append(new Option(value, value, false, value === selected));
}

function voicesOf(info) {
  if (info.voices.length) return info.voices;
  return info.default_voice ? [info.default_voice] : [];
}

function paramInput(name, range) {
  const input = document.createElement("input");
  Object.assign(input, { id: `param-${name}`, type: "number", step: "any", placeholder: "model default" });
  input.dataset.param = name;
  if (range.min !== null) input.min = String(range.min);
  if (range.max !== null) input.max = String(range.max);
  return input;
}

function rangeText(range) {
  const low = range.min === null ? "−∞" : range.min;
  const high = range.max === null ? "∞" : range.max;
  return ` (${low} – ${high})`;
}

function paramField(name, range) {
  const label = document.createElement("label");
  label.htmlFor = `param-${name}`;
  label.textContent = name;
  const hint = document.createElement("small");
  hint.textContent = rangeText(range);
  label.append(hint);
  const field = document.createElement("div");
  field.className = "field";
  field.append(label, paramInput(name, range));
  return field;
}

/** The model's numeric fields that have no input of their own: name -> {min, max}, from
 * their JSON schema (a nullable field is {anyOf: [{type: "number", ...}, {type: "null"}]}). */
function numericFields(fields) {
  const params = {};
  for (const [name, schema] of Object.entries(fields)) {
    const numeric = (schema.anyOf ?? [schema]).find((s) => s.type === "number" || s.type === "integer");
    if (!numeric || name === "speed") continue;
    params[name] = {
      min: numeric.minimum ?? numeric.exclusiveMinimum ?? null,
      max: numeric.maximum ?? numeric.exclusiveMaximum ?? null,
    };
  }
  return params;
}

function renderExtraParams(params) {
  const fieldset = $("extra-params");
  fieldset.querySelectorAll(".field").forEach((field) => field.remove());
  for (const [name, range] of Object.entries(params)) fieldset.append(paramField(name, range));
  fieldset.hidden = Object.keys(params).length === 0;
}

/** Show and fill the inputs the served model accepts; hide the others. */
export function renderForm(info) {
  const supports = (field) => info.supported_fields.includes(field);
  const voices = voicesOf(info);
  fillSelect($("voice"), voices, info.default_voice, info.default_voice ? null : "(choose)");
  show("voice-field", voices.length > 0);
  fillSelect($("language"), info.languages, null, "(model default)");
  show("language-field", supports("language") && info.languages.length > 0);
  show("speed-field", supports("speed"));
  show("instructions-field", supports("instructions"));
  show("reference-field", supports("ref_audio"));
  show("ref-text-field", supports("ref_text"));
  renderExtraParams(numericFields(info.fields));
}

export function readFile(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(new Error(`cannot read ${file.name}: ${reader.error}`));
    reader.readAsDataURL(file);
  });
}

/** Value of the input `id` when it is shown and not empty, else undefined. */
function shownValue(id, fieldId) {
  if ($(fieldId).hidden) return undefined;
  const value = $(id).value.trim();
  return value === "" ? undefined : value;
}

function extraParams() {
  const values = {};
  for (const input of $("extra-params").querySelectorAll("input[data-param]")) {
    if (input.value !== "") values[input.dataset.param] = Number(input.value);
  }
  return values;
}

async function referenceAudio() {
  if ($("reference-field").hidden) return undefined;
  const file = $("ref-audio").files[0];
  return file ? readFile(file) : undefined;
}

function withoutUndefined(body) {
  return Object.fromEntries(Object.entries(body).filter(([, value]) => value !== undefined));
}

/** The speech request body for the form's current values (always raw pcm at the model's
 * own rate, which the page's AudioContext runs at). */
export async function readRequest(info) {
  const speed = shownValue("speed", "speed-field");
  return withoutUndefined({
    model: info.model,
    input: $("text").value,
    voice: shownValue("voice", "voice-field"),
    language: shownValue("language", "language-field"),
    speed: speed === undefined ? undefined : Number(speed),
    instructions: shownValue("instructions", "instructions-field"),
    ref_audio: await referenceAudio(),
    ref_text: $("reference-field").hidden ? undefined : shownValue("ref-text", "ref-text-field"),
    response_format: "pcm",
    sample_rate: info.sample_rate,
    stream: $("stream").checked,
    ...extraParams(),
  });
}
