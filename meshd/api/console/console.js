// meshd's web console: polls /v1/mesh/status once a second, streams chat answers from
// /v1/chat/completions. Plain browser JavaScript, no dependencies, no build step.
"use strict";

const POLL_MS = 1000;
const RATE_WINDOW_MS = 5000; // tokens/s is the rate over the readings of this window
const KEY_STORE = "meshd-api-key";
const $ = (id) => document.getElementById(id);

const readings = []; // {at, generated} of recent readings, for tokens/s
const conversation = []; // the chat's messages, sent whole with each request

function apiKey() {
  return sessionStorage.getItem(KEY_STORE) || "";
}

function headers(extra = {}) {
  const key = apiKey();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

function askForKey(message) {
  $("key-form").hidden = false;
  $("key-error").textContent = message || "";
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY_STORE, $("key").value.trim());
  $("key-form").hidden = true;
  poll();
});

function bytes(n) {
  if (n == null) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function cell(row, text, cls) {
  const td = row.insertCell();
  td.textContent = text;
  if (cls) td.className = cls;
  return td;
}

function fill(tbody, rows) {
  tbody.replaceChildren();
  for (const values of rows) {
    const tr = tbody.insertRow();
    for (const v of values) {
      if (Array.isArray(v)) cell(tr, v[0], v[1]);
      else cell(tr, v);
    }
  }
}

function layers(range) {
  return range ? `${range[0]}–${range[1] - 1}` : "spare";
}

function render(body) {
  const node = body.node;
  const traffic = body.traffic;
  const now = performance.now();
  readings.push({ at: now, generated: traffic.generated_tokens });
  while (readings.length > 2 && now - readings[1].at >= RATE_WINDOW_MS) readings.shift();
  if (readings.length > 1) {
    const first = readings[0];
    const rate = (traffic.generated_tokens - first.generated) / ((now - first.at) / 1000);
    $("tok-s").textContent = rate.toFixed(1);
  }
  $("generated").textContent = traffic.generated_tokens.toFixed(0);
  const drafted = traffic.spec_drafted_tokens;
  $("acceptance").textContent = drafted
    ? `${((100 * traffic.spec_accepted_tokens) / drafted).toFixed(0)} % of ${drafted.toFixed(0)}`
    : "–";
  const select = $("model");
  if (select.options.length !== body.models.length) {
    select.replaceChildren(...body.models.map((m) => new Option(m, m)));
  }
  if (!node) {
    $("node").textContent = `serving ${body.models.join(", ")} (no mesh status here)`;
    return;
  }
  $("node").textContent =
    `node ${node.name} · model ${node.model_id.slice(0, 16)} · ${node.quantization} · ` +
    `${node.threads} thread(s) · up ${Math.round(node.uptime_s)} s`;
  const state = $("state");
  const [text, cls] = node.stopping ? ["stopping", "bad"]
    : node.disabled ? ["killed", "bad"]
    : node.draining ? ["draining", "warn"] : ["serving", "ok"];
  state.textContent = text;
  state.className = `badge ${cls}`;
  $("sessions").textContent = `${node.sessions_coordinated} / ${node.sessions_hosted}`;
  $("kv").textContent = bytes(node.kv_used_bytes);
  $("recoveries").textContent = String(node.recoveries);

  const names = {};
  for (const m of node.members) names[m.key] = m.name;
  fill($("members").tBodies[0], node.members.map((m) => [
    m.name + (m.is_self ? " (this node)" : ""),
    [m.status, `health-${m.status}`],
    m.address || "–",
    m.offers_model ? layers(m.loaded_layers) : "no model",
    m.rtt_ms == null ? "–" : m.rtt_ms.toFixed(2),
    m.packets_sent ? `${m.packets_lost}/${m.packets_sent}` : "–",
    bytes(m.weight_bytes),
    bytes(m.memory_budget_bytes),
    String(m.sessions),
  ]));

  const ms = node.predicted_ms_per_token;
  $("plan-summary").textContent = node.plan.length
    ? `${node.model_id.slice(0, 16)}: ${node.plan.length} stage(s), ${node.plan_quantization}` +
      (ms == null ? "" : `, predicted ${ms.toFixed(2)} ms/token`)
    : "no plan yet";
  fill($("plan").tBodies[0], node.plan.map((s, i) => [
    String(i), names[s.key] || s.key.slice(0, 16), layers(s.layers),
    bytes(s.weight_bytes), bytes(s.memory_bytes),
  ]));
  $("plan-error").textContent = node.plan_error || "";
  // A mesh serving several models: each other model's plan below this node's first one.
  const others = (node.models || []).filter((m) => m.model_id !== node.model_id);
  $("other-plans").replaceChildren(...others.map((m) => {
    const section = document.createElement("div");
    section.className = "model-plan";
    const heading = document.createElement("h3");
    const mms = m.predicted_ms_per_token;
    heading.textContent = `${m.name} (${m.model_id.slice(0, 16)}): ` + (m.plan.length
      ? `${m.plan.length} stage(s), ${m.plan_quantization}` +
        (mms == null ? "" : `, predicted ${mms.toFixed(2)} ms/token`)
      : "no plan yet");
    const table = $("plan").cloneNode(true);
    table.removeAttribute("id");
    fill(table.tBodies[0], m.plan.map((s, i) => [
      String(i), names[s.key] || s.key.slice(0, 16), layers(s.layers),
      bytes(s.weight_bytes), bytes(s.memory_bytes),
    ]));
    const error = document.createElement("p");
    error.className = "error";
    error.textContent = m.plan_error || "";
    section.replaceChildren(heading, table, error);
    return section;
  }));

  const events = $("events");
  events.replaceChildren(...node.events.slice(-30).reverse().map((e) => {
    const li = document.createElement("li");
    const at = new Date(e.at_unix_s * 1000).toLocaleTimeString();
    const who = e.node ? node.members.find((m) => m.key.startsWith(e.node)) : null;
    li.textContent = `${at} ${e.kind} ${who ? who.name : (e.node || "").slice(0, 16)} ${e.detail}`;
    return li;
  }));
}

async function poll() {
  try {
    const response = await fetch("/v1/mesh/status", { headers: headers() });
    if (response.status === 401) {
      askForKey(apiKey() ? "that key was refused" : "");
      return;
    }
    if (!response.ok) throw new Error(`status ${response.status}`);
    render(await response.json());
    document.body.dataset.connected = "yes";
  } catch (err) {
    $("node").textContent = `cannot reach this node: ${err.message}`;
    document.body.dataset.connected = "no";
  }
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = `msg ${role}`;
  const who = document.createElement("span");
  who.className = "who";
  who.textContent = role === "user" ? "you" : "mesh";
  const body = document.createElement("span");
  body.className = "text";
  body.textContent = text;
  div.append(who, body);
  $("transcript").append(div);
  return div;
}

async function send(event) {
  event.preventDefault();
  const prompt = $("prompt").value.trim();
  if (!prompt) return;
  $("prompt").value = "";
  $("send").disabled = true;
  addMessage("user", prompt);
  conversation.push({ role: "user", content: prompt });
  const answer = addMessage("assistant", "");
  const text = answer.querySelector(".text");
  const started = performance.now();
  let pieces = 0;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: headers({ "Content-Type": "application/json" }),
      body: JSON.stringify({
        model: $("model").value, messages: conversation, stream: true, max_tokens: 200,
      }),
    });
    if (response.status === 401) { askForKey(""); throw new Error("the API key is needed"); }
    if (!response.ok) {
      const err = await response.json().catch(() => ({}));
      throw new Error((err.error && err.error.message) || `HTTP ${response.status}`);
    }
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const frame = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        for (const line of frame.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message);
          const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
          if (delta && delta.content) { text.textContent += delta.content; pieces++; }
        }
      }
      $("transcript").scrollTop = $("transcript").scrollHeight;
    }
    conversation.push({ role: "assistant", content: text.textContent });
    const stats = document.createElement("div");
    stats.className = "stats";
    stats.textContent = `${pieces} chunks in ${((performance.now() - started) / 1000).toFixed(1)} s`;
    answer.append(stats);
    answer.dataset.done = "yes";
  } catch (err) {
    conversation.pop();
    const error = document.createElement("div");
    error.className = "error";
    error.textContent = err.message;
    answer.append(error);
    answer.dataset.done = "error";
  } finally {
    $("send").disabled = false;
  }
}

$("chat-form").addEventListener("submit", send);
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) send(event);
});
poll();
setInterval(poll, POLL_MS);
