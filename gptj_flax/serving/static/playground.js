// The gptj_flax playground: a page that continues a prompt with the served model.
//
// It is also an example client of the server's public API, and uses nothing else:
//   GET  v1/models       the model's name, dtype and context (401 when the server wants a key)
//   GET  health          ready / warming up / draining, and the prompts waiting (no key needed)
//   POST v1/completions  with stream: true, read as server-sent events, and logprobs for the colours
// URLs are relative, so the page also works behind a proxy that serves the API under a sub-path.
"use strict";

const $ = (id) => document.getElementById(id);

const HEALTH_EVERY_MS = 5000;
// The server takes at most 4 stop strings (OpenAI's limit).
const MAX_STOP_STRINGS = 4;
// Probability bands of the token colours, lowest first; the legend shows the same five.
const BANDS = [0.1, 0.3, 0.6, 0.9];

// The API key is held in this variable (and the password field) only: never in localStorage or a
// cookie, so it is gone when the tab closes, and no other page of this origin can read it later.
let apiKey = "";
let controller = null; // the AbortController of the generation in flight, if any

// What the output shows: the generated text as code points (the server's text_offset counts code
// points, as Python strings do; a JavaScript string counts UTF-16 units), and its tokens grouped by
// the offset where their text starts: the byte tokens of one character share its offset.
const output = { chars: [], groups: [], base: null, painted: [], active: -1 };

// ---- talking to the server --------------------------------------------------------------------

function headers(extra = {}) {
  return apiKey ? { ...extra, Authorization: `Bearer ${apiKey}` } : extra;
}

// A refusal as one line: the server's errors are {"detail": "..."}, and a 422's detail is a list
// of {loc, msg}, each naming the field at fault.
async function refusalText(response) {
  let detail = response.statusText;
  try {
    const body = await response.json();
    if (typeof body.detail === "string") {
      detail = body.detail;
    } else if (Array.isArray(body.detail)) {
      detail = body.detail.map((e) => `${e.loc.slice(1).join(".") || "body"}: ${e.msg}`).join("; ");
    }
  } catch {
    // not JSON (a proxy's page): the status line says enough
  }
  return `${response.status}: ${detail}`;
}

// Yields the data of each server-sent event of a streamed response. This server ends every event
// with a blank line and sends only `data:` fields.
async function* serverSentEvents(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event
        .split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, ""))
        .join("\n");
      if (data) yield data;
    }
  }
}

// The header's model line: the name (/health has it, without a key) and what /v1/models adds.
const model = { name: "", details: ["loading…"] };

function showModel() {
  $("model").textContent = [model.name || "model", ...model.details].join(" · ");
}

async function loadModel() {
  let response;
  try {
    response = await fetch("v1/models", { headers: headers() });
  } catch {
    return; // the health line already says the server cannot be reached
  }
  if (response.status === 401) {
    showKeyBox();
    model.details = [apiKey ? "the key was refused" : "needs an API key"];
    showModel();
    if (apiKey) showError(await refusalText(response));
    return;
  }
  if (!response.ok) {
    model.details = [await refusalText(response)];
    showModel();
    return;
  }
  const card = (await response.json()).data[0];
  model.name = card.id;
  model.details = [card.dtype, card.quantization && `${card.quantization} weights`].filter(Boolean);
  model.details.push(`${card.max_model_len.toLocaleString("en")}-token context`);
  showModel();
  // The prompt takes at least one position, so a completion has at most context - 1 tokens.
  const most = card.max_model_len - 1;
  $("max-tokens").max = most;
  if (Number($("max-tokens").value) > most) $("max-tokens").value = most;
  if (apiKey) hideError();
}

const HEALTH_WORDS = {
  ready: "ready",
  warming_up: "warming up (compiling)",
  draining: "shutting down",
  failed: "failed",
  stopped: "stopped",
};

async function pollHealth() {
  let state = "down";
  let text = "cannot be reached";
  try {
    // /health answers 503 while warming up or draining, with the same body: read it either way.
    const health = await (await fetch("health", { cache: "no-store" })).json();
    state = health.status;
    text = HEALTH_WORDS[health.status] || health.status;
    if (health.queued_prompts) text += ` · ${health.queued_prompts} waiting`;
    if (!model.name) {
      model.name = health.model;
      showModel();
    }
  } catch {
    // no answer, or not this server's: leave it "cannot be reached"
  }
  $("health").dataset.state = state;
  $("health-text").textContent = `server ${text}`;
  setTimeout(pollHealth, HEALTH_EVERY_MS);
}

// ---- the form ---------------------------------------------------------------------------------

class InputError extends Error {}

function integer(id, name, min, max) {
  const field = $(id);
  const value = Number(field.value);
  if (field.value.trim() === "" || !Number.isInteger(value) || value < min || (max !== undefined && value > max)) {
    field.focus();
    throw new InputError(`${name} must be a whole number${max === undefined ? ` ≥ ${min}` : ` from ${min} to ${max}`}`);
  }
  return value;
}

// "a, b\,c, \n\n" -> ["a", "b,c", "\n\n"]: commas separate, a backslash escapes; the spaces typed
// around a string are dropped, so a space that matters there is written \s.
const ESCAPES = { n: "\n", t: "\t", s: " " };

function stopStrings(text) {
  const strings = [];
  let chars = []; // {c, typed}: only typed spaces are trimmed, never an escaped one
  const flush = () => {
    while (chars.length && chars[0].typed && chars[0].c === " ") chars.shift();
    while (chars.length && chars[chars.length - 1].typed && chars[chars.length - 1].c === " ") chars.pop();
    if (chars.length) strings.push(chars.map((x) => x.c).join(""));
    chars = [];
  };
  for (let i = 0; i < text.length; i++) {
    if (text[i] === "\\" && i + 1 < text.length) {
      const next = text[++i];
      chars.push({ c: ESCAPES[next] ?? next, typed: false });
    } else if (text[i] === ",") {
      flush();
    } else {
      chars.push({ c: text[i], typed: true });
    }
  }
  flush();
  return strings;
}

function requestBody() {
  const body = {
    prompt: $("prompt").value,
    max_tokens: integer("max-tokens", "Max tokens", 1, Number($("max-tokens").max) || undefined),
    temperature: Number($("temperature").value),
    top_p: Number($("top-p").value),
    top_k: integer("top-k", "Top-k", 0),
    // Always asked for, so that the colours can be turned on after a generation too.
    logprobs: integer("alternatives", "Alternatives shown", 1, 20),
    stream: true,
  };
  const stop = stopStrings($("stop-strings").value);
  if (stop.length > MAX_STOP_STRINGS) {
    $("stop-strings").focus();
    throw new InputError(`at most ${MAX_STOP_STRINGS} stop strings (there are ${stop.length})`);
  }
  if (stop.length) body.stop = stop;
  if ($("seed").value.trim() !== "") body.seed = integer("seed", "Seed", 0, 2 ** 32 - 1);
  return body;
}

// ---- generating -------------------------------------------------------------------------------

async function generate() {
  if (controller) return;
  hideError();
  let body;
  try {
    body = requestBody();
  } catch (e) {
    if (!(e instanceof InputError)) throw e;
    showError(e.message);
    return;
  }
  clearOutput(body.prompt);
  controller = new AbortController();
  setRunning(true);
  const started = performance.now();
  let firstToken = null;
  let finish = null;
  let answered = false;
  try {
    const response = await fetch("v1/completions", {
      method: "POST",
      headers: headers({ "Content-Type": "application/json" }),
      body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!response.ok) {
      if (response.status === 401) showKeyBox();
      showError(await refusalText(response));
      return;
    }
    answered = true;
    for await (const data of serverSentEvents(response.body)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) {
        showError(chunk.error.message);
        break;
      }
      const choice = chunk.choices[0];
      if (choice.text && firstToken === null) firstToken = performance.now() - started;
      addOutput(choice.text, choice.logprobs);
      finish = choice.finish_reason || finish;
    }
  } catch (e) {
    if (e.name === "AbortError") {
      finish = "stopped"; // leaving the stream closes the connection: the server frees the slot
    } else {
      showError(`no answer from the server (${e.message})`);
    }
  } finally {
    controller = null;
    setRunning(false);
    if (answered || finish === "stopped") showStats(performance.now() - started, firstToken, finish);
  }
}

function stop() {
  if (controller) controller.abort();
}

function setRunning(running) {
  $("generate").disabled = running;
  $("stop").disabled = !running;
  $("continue").disabled = running || output.chars.length === 0;
  $("cursor").hidden = !running;
  $("output").setAttribute("aria-busy", String(running));
}

const FINISH_WORDS = {
  length: "reached max tokens",
  stop: "ended (end of text or a stop string)",
  stopped: "stopped",
};

function showStats(elapsedMs, firstTokenMs, finish) {
  const tokens = output.groups.reduce((n, g) => n + g.tokens.length, 0);
  const seconds = elapsedMs / 1000;
  const parts = [`${tokens} token${tokens === 1 ? "" : "s"}`, `${seconds.toFixed(1)} s`];
  if (tokens && seconds > 0) parts.push(`${(tokens / seconds).toFixed(1)} tokens/s`);
  if (firstTokenMs !== null) parts.push(`first after ${(firstTokenMs / 1000).toFixed(2)} s`);
  if (finish) parts.push(FINISH_WORDS[finish] || finish);
  $("stats").textContent = parts.join(" · ");
}

// ---- the output and its colours ---------------------------------------------------------------

function clearOutput(prompt) {
  output.chars = [];
  output.groups = [];
  output.base = null;
  output.painted = [];
  hideTip();
  $("echo").textContent = prompt;
  $("completion").textContent = "";
  $("stats").textContent = "";
}

function colouring() {
  return $("colour").checked;
}

function addOutput(text, logprobs) {
  output.chars.push(...Array.from(text));
  if (logprobs) {
    logprobs.tokens.forEach((token, i) => {
      // Offsets count from the start of the prompt; the first generated token starts the output.
      if (output.base === null) output.base = logprobs.text_offset[i];
      const start = logprobs.text_offset[i] - output.base;
      const last = output.groups[output.groups.length - 1];
      const entry = { token, logprob: logprobs.token_logprobs[i], top: logprobs.top_logprobs[i] || {} };
      if (last && last.start === start) last.tokens.push(entry);
      else output.groups.push({ start, tokens: [entry] });
    });
  }
  if (colouring() && output.groups.length) paintTokens();
  else if (text) $("completion").append(text);
}

function groupText(i) {
  const groups = output.groups;
  const end = i + 1 < groups.length ? groups[i + 1].start : output.chars.length;
  return output.chars.slice(groups[i].start, end).join("");
}

function groupProbability(group) {
  return Math.exp(group.tokens.reduce((sum, t) => sum + t.logprob, 0));
}

function band(p) {
  return BANDS.filter((edge) => p >= edge).length;
}

// Paints the groups not painted yet and repaints the last painted one: only the last group's text
// can still grow (a group's text ends where the next group starts).
function paintTokens() {
  const completion = $("completion");
  if (output.painted.length === 0) completion.textContent = "";
  for (let i = Math.max(0, output.painted.length - 1); i < output.groups.length; i++) {
    let span = output.painted[i];
    if (!span) {
      span = document.createElement("span");
      span.dataset.group = String(i);
      completion.append(span);
      output.painted.push(span);
    }
    span.textContent = groupText(i);
    span.className = `tok p${band(groupProbability(output.groups[i]))}`;
  }
}

function repaint() {
  output.painted = [];
  output.active = -1;
  hideTip();
  $("output").classList.toggle("coloured", colouring());
  $("output-help").hidden = !colouring();
  if (colouring() && output.groups.length) paintTokens();
  else $("completion").textContent = output.chars.join("");
}

// How a token's text is shown in the alternatives: spaces and line ends made visible.
function visible(text) {
  if (text === "") return "∅";
  return text.replace(/ /g, "␣").replace(/\n/g, "↵").replace(/\t/g, "⇥");
}

function percent(logprob) {
  const p = 100 * Math.exp(logprob);
  return p >= 10 ? `${p.toFixed(0)}%` : p >= 0.1 ? `${p.toFixed(1)}%` : "<0.1%";
}

function showTip(span) {
  const group = output.groups[Number(span.dataset.group)];
  const tip = $("tip");
  tip.replaceChildren();
  for (const token of group.tokens) {
    const table = document.createElement("table");
    const caption = table.createCaption();
    caption.textContent = `${visible(token.token)} · ${percent(token.logprob)}`;
    const ranked = Object.entries(token.top).sort((a, b) => b[1] - a[1]);
    for (const [text, logprob] of ranked) {
      const row = table.insertRow();
      if (text === token.token) row.className = "chosen";
      const name = row.insertCell();
      name.textContent = visible(text);
      const bar = row.insertCell();
      const fill = document.createElement("span");
      fill.className = "fill";
      // a CSSOM property, which the page's Content-Security-Policy allows (a style attribute it would not)
      fill.style.width = `${Math.max(1, 100 * Math.exp(logprob))}%`;
      bar.append(fill);
      row.insertCell().textContent = percent(logprob);
    }
    tip.append(table);
  }
  tip.hidden = false;
  // Below the token (above it where the window ends first), kept within the output box's width.
  const box = $("output").parentElement.getBoundingClientRect();
  const at = span.getBoundingClientRect();
  const left = Math.min(at.left - box.left, box.width - tip.offsetWidth - 4);
  const below = at.bottom + 6 + tip.offsetHeight <= window.innerHeight || at.top - 6 - tip.offsetHeight < 0;
  tip.style.left = `${Math.max(4, left)}px`;
  tip.style.top = `${below ? at.bottom - box.top + 6 : at.top - box.top - 6 - tip.offsetHeight}px`;
  for (const other of $("completion").querySelectorAll(".tok.active")) other.classList.remove("active");
  span.classList.add("active");
  output.active = Number(span.dataset.group);
}

function hideTip() {
  $("tip").hidden = true;
  for (const span of $("completion").querySelectorAll(".tok.active")) span.classList.remove("active");
}

// With the output focused, ← and → move through the tokens that have text (one tab stop, not one
// per token); Escape hides the alternatives.
function stepTokens(event) {
  if (!colouring() || output.painted.length === 0) return;
  if (event.key === "Escape") {
    hideTip();
    return;
  }
  const step = { ArrowRight: 1, ArrowLeft: -1 }[event.key];
  if (!step) return;
  event.preventDefault();
  let i = output.active;
  do {
    i += step;
  } while (i >= 0 && i < output.painted.length && output.painted[i].textContent === "");
  if (i < 0 || i >= output.painted.length) return;
  output.painted[i].scrollIntoView({ block: "nearest" });
  showTip(output.painted[i]);
}

// ---- errors, the key, and wiring ----------------------------------------------------------------

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = false;
}

function hideError() {
  $("error").hidden = true;
  $("error").textContent = "";
}

function showKeyBox() {
  $("key-box").hidden = false;
}

function syncSlider(id) {
  $(`${id}-value`).textContent = $(id).value;
}

function init() {
  $("form").addEventListener("submit", (event) => {
    event.preventDefault();
    generate();
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) {
      event.preventDefault();
      generate();
    }
  });
  $("stop").addEventListener("click", stop);
  $("continue").addEventListener("click", () => {
    $("prompt").value = $("echo").textContent + output.chars.join("");
    generate();
  });
  $("key").addEventListener("input", () => {
    apiKey = $("key").value.trim();
  });
  $("key").addEventListener("change", loadModel); // once typed: is it accepted, and what model is it?
  for (const id of ["temperature", "top-p"]) {
    $(id).addEventListener("input", () => syncSlider(id));
    syncSlider(id);
  }
  $("colour").addEventListener("change", repaint);
  const completion = $("completion");
  completion.addEventListener("mouseover", (event) => {
    if (event.target.classList.contains("tok")) showTip(event.target);
  });
  completion.addEventListener("click", (event) => {
    if (event.target.classList.contains("tok")) showTip(event.target); // a tap, where there is no hover
  });
  $("output").addEventListener("mouseleave", hideTip);
  $("output").addEventListener("keydown", stepTokens);
  $("output").addEventListener("blur", hideTip);
  repaint();
  loadModel();
  pollHealth();
}

init();
