// hookctl console: one page over the operator's requests (POST /api/operator). Plain
// JavaScript, no dependencies; everything shown is set as text, never as HTML.
"use strict";

const state = { whoami: null, refresh: null, paused: false, eventsAfter: [], generation: 0 };

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (key === "onclick" || key === "onsubmit" || key === "onchange") node[key] = value;
    else if (value !== null && value !== undefined) node.setAttribute(key, value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

async function ask(request) {
  const response = await fetch("/api/operator", {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify(request),
    credentials: "same-origin",
  });
  const answer = await response.json().catch(() => ({ error: response.statusText }));
  if (!response.ok) throw new Error(answer.error || response.statusText);
  return answer;
}

// Nothing absent is shown: replaceChildren would write null as text.
function present(nodes) {
  return nodes.filter((node) => node !== null && node !== undefined);
}

function show(...nodes) {
  const main = document.getElementById("main");
  main.replaceChildren(...present(nodes));
}

// A page shows what it read only if no other page was asked for meanwhile: a slow answer for
// the page left behind never replaces the one the operator went to.
function showIf(generation, ...nodes) {
  if (generation === state.generation) show(...nodes);
}

function failure(error) {
  return el("p", { class: "error", id: "error" }, String(error.message || error));
}

function age(iso) {
  if (!iso) return "never";
  const seconds = Math.max(0, (Date.now() - Date.parse(iso)) / 1000);
  if (seconds < 90) return `${Math.round(seconds)} s ago`;
  if (seconds < 5400) return `${Math.round(seconds / 60)} min ago`;
  if (seconds < 172800) return `${Math.round(seconds / 3600)} h ago`;
  return `${Math.round(seconds / 86400)} d ago`;
}

function table(id, headings, rows) {
  return el(
    "table",
    { id },
    headings.some((h) => h.label || h)
      ? el("thead", {}, el("tr", {}, headings.map((h) => el("th", { class: h.num ? "num" : null }, h.label || h))))
      : null,
    el("tbody", {}, rows),
  );
}

// A source's hours as bars, the mean of the same hours of past weeks as a line.
function chart(hours) {
  const svg = "http://www.w3.org/2000/svg";
  const width = 240, height = 36, step = width / Math.max(hours.length, 1);
  const top = Math.max(1, ...hours.map((h) => Math.max(h.events, h.usual || 0)));
  const y = (v) => height - (v / top) * (height - 2);
  const node = document.createElementNS(svg, "svg");
  node.setAttribute("width", width);
  node.setAttribute("height", height);
  node.setAttribute("class", "chart");
  hours.forEach((h, i) => {
    const bar = document.createElementNS(svg, "rect");
    bar.setAttribute("x", i * step + 1);
    bar.setAttribute("y", y(h.events));
    bar.setAttribute("width", Math.max(1, step - 2));
    bar.setAttribute("height", height - y(h.events));
    bar.setAttribute("fill", "#5b7bd5");
    const title = document.createElementNS(svg, "title");
    title.textContent = `${new Date(h.hour).toLocaleString()}: ${h.events} (usually ${h.usual === null ? "unknown" : h.usual.toFixed(1)})`;
    bar.append(title);
    node.append(bar);
  });
  const usual = hours.map((h, i) => (h.usual === null ? null : `${i * step + step / 2},${y(h.usual)}`)).filter(Boolean);
  if (usual.length > 1) {
    const line = document.createElementNS(svg, "polyline");
    line.setAttribute("points", usual.join(" "));
    line.setAttribute("fill", "none");
    line.setAttribute("stroke", "#c2410c");
    line.setAttribute("stroke-width", "1.5");
    node.append(line);
  }
  return node;
}

// Overview: the status verdict first, then what it rests on.
async function overview() {
  const gen = state.generation;
  let report, refusals, hours;
  try {
    [report, refusals, hours] = await Promise.all([
      ask({ action: "status" }),
      ask({ action: "list_refused", limit: 1 }),
      ask({ action: "source_hours", hours: 24 }),
    ]);
  } catch (error) {
    return showIf(gen, el("h1", {}, "Overview"), failure(error));
  }
  const refusedLastDay = refusals.last_day.reduce((sum, s) => sum + s.refused_last_day, 0);
  const verdict = report.verdict === "accounted_for"
    ? "Every event accounted for"
    : "Needs attention";
  const findings = (report.findings || []).map((f) =>
    el("li", {}, `${f.detail} `, el("span", { class: "muted" }, `(${f.next})`)));
  const sources = (report.sources || []).map((s) =>
    el("tr", { "data-source": s.source_id },
      el("td", {}, s.source_id), el("td", {}, s.tenant_id), el("td", {}, s.scheme),
      el("td", {}, age(s.last_received_at)),
      el("td", { class: "num" }, s.events_last_hour),
      el("td", { class: "num" }, s.usual_hour && s.usual_hour.mean !== null ? s.usual_hour.mean.toFixed(1) : "–"),
      el("td", { class: "num" }, s.events_last_day),
      el("td", { class: "num" }, s.duplicates_last_day),
      el("td", { class: "num" }, s.conflicts_last_day),
      el("td", { class: "num" }, s.refused_last_day),
      el("td", { class: "num", "data-refused": s.source_id }, refusals.last_day
        .filter((r) => r.source_id === s.source_id).reduce((sum, r) => sum + r.refused_last_day, 0)),
      el("td", { class: "num", "data-pending": s.source_id }, `${s.pending_capped ? "≥ " : ""}${s.pending ?? 0}`),
      el("td", { class: "num" }, s.pending ? Math.round(s.oldest_pending_age_seconds) : "–"),
      el("td", { class: "num", "data-gaps": s.source_id }, s.open_gaps ?? 0),
      el("td", {}, chart(hours.source_hours.filter((h) => h.source_id === s.source_id)))));
  const checks = (report.breaching_checks || []).map((c) =>
    el("li", { "data-check": c.check_name || c.name }, `${c.check_name || c.name}: ${c.detail || ""}`));
  const queue = report.queue || {};
  const subscriptions = (report.subscriptions || []).map((u) =>
    el("tr", {}, el("td", {}, u.tenant_id), el("td", {}, u.name),
      el("td", { class: "num" }, u.undelivered), el("td", { class: "num" }, Math.round(u.oldest_age_seconds)),
      el("td", { class: "num" }, u.failed), el("td", {}, u.paused ? "paused" : "")));
  const b = report.buffer;
  const buffer = !b ? el("p", { class: "muted", id: "buffer" }, "none configured")
    : b.unknown ? el("p", { class: "error", id: "buffer" }, `cannot be counted: ${b.unknown}`)
    : table("buffer", ["", { label: "count", num: true }], [
      ["waiting", b.waiting], ["in flight", b.in_flight], ["delayed", b.delayed],
      ["dead letters", b.dead_letters],
      ["oldest (s)", b.oldest_age_seconds === null ? (b.oldest_age_unknown || "–") : Math.round(b.oldest_age_seconds)],
    ].map(([k, v]) => el("tr", {}, el("td", {}, k), el("td", { class: "num" }, v))));
  showIf(gen, 
    el("h1", {}, "Overview"),
    el("div", { id: "verdict", class: `verdict ${report.verdict}` }, verdict),
    findings.length ? el("ul", { id: "findings" }, findings) : null,
    el("p", {},
      el("label", {}, el("input", {
        type: "checkbox", id: "pause",
        onchange: (e) => { state.paused = e.target.checked; },
      }), " pause refresh"),
      el("span", { class: "muted" }, ` refreshed ${new Date().toLocaleTimeString()}`)),
    el("h2", {}, "Sources"),
    table("sources", ["source", "tenant", "scheme", "last event",
      { label: "last hour", num: true }, { label: "usual hour", num: true },
      { label: "last day", num: true }, { label: "duplicates", num: true },
      { label: "conflicts", num: true }, { label: "unreadable (400)", num: true },
      { label: "refused, last day", num: true }, { label: "pending", num: true },
      { label: "oldest pending (s)", num: true }, { label: "open gaps", num: true },
      "last 24 h (bars) against the same hours of past weeks (line)"], sources),
    el("h2", {}, "Queue and what waits on a person"),
    table("waiting", ["", { label: "count", num: true }], [
      el("tr", {}, el("td", {}, "pending"), el("td", { class: "num" }, queue.depth)),
      el("tr", {}, el("td", {}, "oldest pending (s)"), el("td", { class: "num" }, Math.round(queue.oldest_pending_age_seconds || 0))),
      el("tr", {}, el("td", {}, "pending past SLA"), el("td", { class: "num" }, queue.pending_past_sla)),
      el("tr", {}, el("td", {}, "open dead letters"), el("td", { class: "num", id: "open-dead-letters" }, report.open_dead_letters)),
      el("tr", {}, el("td", {}, "open gaps"), el("td", { class: "num" }, report.open_gaps)),
      el("tr", {}, el("td", {}, "outbox failed"), el("td", { class: "num" }, (report.outbox || {}).failed)),
      el("tr", {}, el("td", {}, el("a", { href: "#/refused" }, "refused before storing, last day")),
        el("td", { class: "num", id: "refused-last-day" }, refusedLastDay)),
    ]),
    el("h2", {}, "Subscriptions"),
    subscriptions.length
      ? table("subscriptions", ["tenant", "subscription", { label: "undelivered", num: true },
        { label: "oldest (s)", num: true }, { label: "failed", num: true }, ""], subscriptions)
      : el("p", { class: "muted" }, "none"),
    el("h2", {}, "The SQS buffer"),
    buffer,
    el("h2", {}, "Breaching checks"),
    checks.length ? el("ul", { id: "checks" }, checks) : el("p", { class: "muted" }, "none"),
  );
}

// Events: a search over stored events, newest first, a page at a time.
function eventSearch() {
  const params = new URLSearchParams(location.hash.split("?")[1] || "");
  const search = {};
  for (const [param, field] of [["source", "source_id"], ["type", "event_type"], ["status", "status"], ["id", "external_id"]]) {
    if (params.get(param)) search[field] = params.get(param);
  }
  if (params.get("since")) search.since = new Date(params.get("since")).toISOString();
  if (params.get("until")) search.until = new Date(params.get("until")).toISOString();
  if (params.get("contains")) search.contains = JSON.parse(params.get("contains"));
  return { params, search };
}

async function events() {
  const gen = state.generation;
  let params, search;
  try {
    ({ params, search } = eventSearch());
  } catch (error) {
    return showIf(gen, el("h1", {}, "Events"), failure(new Error(`the payload filter is not JSON: ${error.message}`)));
  }
  const field = (name, label, placeholder) =>
    el("label", {}, label, el("input", { name, id: `search-${name}`, value: params.get(name) || "", placeholder }));
  const form = el("form", {
    class: "search", id: "search",
    onsubmit: (e) => {
      e.preventDefault();
      const query = new URLSearchParams();
      for (const input of form.querySelectorAll("input, select")) {
        if (input.type === "checkbox" ? input.checked : input.value) query.set(input.name, input.value);
      }
      state.eventsAfter = [];
      location.hash = `#/events?${query}`;
    },
  },
  field("source", "source"), field("type", "event type"),
  el("label", {}, "state", el("select", { name: "status", id: "search-status" },
    ["", "pending", "processed", "dead_lettered"].map((s) =>
      el("option", { value: s, selected: params.get("status") === s ? "" : null }, s || "any")))),
  field("id", "provider event id"), field("since", "since", "2026-12-01T00:00"),
  field("until", "until"), field("contains", "payload contains (JSON)", '{"type":"push"}'),
  el("label", {}, "live", el("input", {
    type: "checkbox", name: "live", value: "1", id: "search-live",
    checked: params.get("live") ? "" : null,
  })),
  el("button", { type: "submit", id: "search-button" }, "Search"));
  let answer;
  try {
    const after = state.eventsAfter[state.eventsAfter.length - 1];
    answer = await ask({ action: "list_events", search: after ? { ...search, after } : search, limit: 50 });
  } catch (error) {
    return showIf(gen, el("h1", {}, "Events"), form, failure(error));
  }
  const rows = answer.events.map((e) =>
    el("tr", {},
      el("td", {}, el("a", { href: `#/event/${encodeURIComponent(e.tenant_id)}/${encodeURIComponent(e.external_id)}`, class: "event-link" }, e.external_id)),
      el("td", {}, e.source_id), el("td", {}, e.event_type), el("td", {}, e.status),
      el("td", {}, new Date(e.first_received_at).toLocaleString()),
      el("td", { class: "num" }, e.delivery_count), el("td", { class: "num" }, e.conflict_count)));
  showIf(gen, 
    el("h1", {}, "Events"), form,
    table("events", ["provider event id", "source", "type", "state", "first received",
      { label: "deliveries", num: true }, { label: "conflicts", num: true }], rows),
    rows.length ? null : el("p", { class: "muted", id: "no-events" }, "No event matches."),
    answer.next ? el("button", {
      id: "next-page",
      onclick: () => { state.eventsAfter.push(answer.next); route(); },
    }, "Older") : null,
    el("p", { class: "muted", id: "events-shown" }, `${rows.length} shown, newest first`
      + (params.get("live") && !state.eventsAfter.length ? `; live, read ${new Date().toLocaleTimeString()}` : "")),
  );
  // A live tail: the first page read again every two seconds while it is shown.
  if (params.get("live") && !state.eventsAfter.length) {
    const shown = location.hash;
    state.refresh = setTimeout(() => { if (location.hash === shown) route(); }, 2000);
  }
}

// One event: what it is, where it stands, its bytes, and what became of it.
async function event(tenant, externalId) {
  const gen = state.generation;
  let answer, history;
  try {
    [answer, { history }] = await Promise.all([
      ask({ action: "show_event", tenant_id: tenant, external_id: externalId }),
      ask({ action: "event_history", tenant_id: tenant, external_id: externalId }),
    ]);
  } catch (error) {
    return showIf(gen, el("h1", {}, externalId), failure(error));
  }
  const e = answer.event;
  const f = history.filing;
  const facts = [
    ["tenant", e.tenant_id], ["source", e.source_id], ["type", e.event_type],
    ["entity", e.entity_id ? `${e.entity_id} (version ${e.entity_version ?? "–"})` : "–"],
    ["state", e.status], ["first received", e.first_received_at], ["last seen", e.last_seen_at],
    ["deliveries", e.delivery_count], ["last delivery", f.last_delivery_outcome],
    ["conflicts", e.conflict_count], ["processed", e.processed_at || "–"],
    ["processing tries", f.attempts], ["last error", f.last_error || "–"],
    ["verified by", `${f.scheme}${f.verified_layout ? `, layout ${f.verified_layout}` : ""}, with the ${f.verified_with} secret`],
    ["came through the SQS buffer", f.buffered_deliveries ? `yes: ${f.buffered_deliveries} of its deliveries` : "no"],
    ["id", f.id_outside_signature ? "outside the signature (its body is stored once)" : "signed"],
    ["payload SHA-256", f.payload_sha256],
    ["replaced payload SHA-256", f.superseded_sha256 || "–"],
    ["queue", history.queued ? `waiting since ${history.queued.enqueued_at}, ready at ${history.queued.ready_at}` : "not queued"],
  ].map(([k, v]) => el("tr", {}, el("th", {}, k), el("td", { "data-fact": k }, v)));
  let bytes;
  if (answer.purged) bytes = el("p", { class: "muted", id: "payload" }, "Retention purged the payload; the record stays.");
  else if (answer.data !== null && answer.data !== undefined) bytes = el("pre", { id: "payload" }, JSON.stringify(answer.data, null, 2));
  else bytes = el("pre", { id: "payload" }, answer.data_base64 || "");
  const headers = Object.entries(f.headers || {}).map(([k, v]) => el("tr", {}, el("th", {}, k), el("td", {}, v)));
  // The entity before and after: the announcement of this event's change names both versions;
  // an event that changed nothing shows what the projection holds instead.
  const announced = history.outbox.find((m) => m.change);
  const n = history.entity;
  let entity = null;
  if (f.entity_id) {
    const now = n ? `${n.entity_type} ${n.entity_id} holds version ${n.version}${n.deleted ? " (deleted)" : ""}, from event ${n.last_event_id}` : "the projection holds no such entity";
    entity = el("p", { id: "entity" }, announced
      ? `Changed ${announced.change.entity_type} ${announced.change.entity_id} from version ${announced.change.previous_version ?? "none (new)"} to ${announced.change.version}${announced.change.deleted ? " (deleted)" : ""}. Now: ${now}.`
      : f.entity_version === null || f.entity_version === undefined
        ? `This event names the entity without a version: the projection takes no change from it. Now: ${now}.`
        : `This event carries version ${f.entity_version} and changed nothing${{ pending: " yet (it waits in the queue)", processed: ": the projection held a later version", dead_lettered: " (it was dead-lettered)" }[e.status] || ""}. Now: ${now}.`);
  }
  const outbox = history.outbox.map((m) => el("tr", {},
    el("td", {}, m.action), el("td", {}, m.status), el("td", { class: "num" }, m.attempts),
    el("td", {}, m.destination || "–"), el("td", {}, m.delivered_at || m.tried_at || "–"),
    el("td", {}, m.last_error || "")));
  const letters = history.dead_letters.map((d) => el("tr", {},
    el("td", {}, d.dead_letter_id), el("td", {}, d.status), el("td", {}, d.reason), el("td", {}, d.error),
    el("td", { class: "num" }, d.replay_count), el("td", {}, d.replayed_at || "–")));
  const anomalies = history.anomalies.map((a) => el("tr", {},
    el("td", {}, a.detected_at), el("td", {}, a.kind), el("td", {}, a.detail),
    el("td", {}, a.payload_sha256.slice(0, 16)), el("td", {}, (a.stored_sha256 || "–").slice(0, 16))));
  showIf(gen, 
    el("h1", { id: "event-id" }, e.external_id),
    table("event", ["", ""], facts),
    entity ? el("h2", {}, "Effect on its entity") : null, entity,
    el("h2", {}, "Effects: outbox messages"),
    outbox.length ? table("outbox", ["action", "state", { label: "tries", num: true }, "destination", "when", "last error"], outbox)
      : el("p", { class: "muted", id: "outbox" }, "No outbox message."),
    el("h2", {}, "Dead letters and replays"),
    letters.length ? table("letters", ["id", "state", "why", "error", { label: "replays", num: true }, "replayed"], letters)
      : el("p", { class: "muted", id: "letters" }, "Never dead-lettered."),
    el("h2", {}, "Anomalies"),
    anomalies.length ? table("anomalies", ["detected", "kind", "detail", "delivered SHA-256", "stored SHA-256"], anomalies)
      : el("p", { class: "muted", id: "anomalies" }, "None."),
    el("h2", {}, "Headers kept"), table("headers", ["", ""], headers),
    el("h2", {}, "Payload"), bytes);
}

// Asks for a reason, then sends a change; shows what came back in #action-outcome.
async function change(question, request) {
  const reason = prompt(question);
  if (!reason) return;
  const outcome = document.getElementById("action-outcome");
  const shown = location.hash;
  try {
    outcome.textContent = JSON.stringify(await ask({ ...request, reason }));
    // Read again what changed, unless the operator has gone to another page meanwhile.
    setTimeout(() => { if (location.hash === shown) route(); }, 500);
  } catch (err) {
    outcome.textContent = err.message;
  }
}

function writeButton(label, attrs, onclick) {
  const canWrite = state.whoami && state.whoami.write;
  return el("button", {
    ...attrs, disabled: canWrite ? null : "",
    title: canWrite ? "" : "read-only: start hookctl console with --write",
    onclick,
  }, label);
}

// Open gaps: ids the provider's sequence says are missing; backfill asks the provider, a
// tombstone says one will never come.
async function gaps() {
  const gen = state.generation;
  let answer;
  try {
    answer = await ask({ action: "list_gaps" });
  } catch (error) {
    return showIf(gen, el("h1", {}, "Gaps"), failure(error));
  }
  const rows = answer.gaps.map((g, i) => el("tr", {},
    el("td", {}, g.source_id), el("td", {}, g.external_id), el("td", {}, g.sequence ?? "–"),
    el("td", {}, age(g.first_seen_at)), el("td", {}, g.in_grace ? "in grace" : "past grace"),
    el("td", { class: "num" }, g.attempts), el("td", {}, g.last_error || ""),
    el("td", {}, g.backfill_requested_at ? `asked ${age(g.backfill_requested_at)}` : "–"),
    el("td", {},
      writeButton("Backfill now", { class: "backfill", id: `backfill-${i}` }, () =>
        change(`Fetch ${g.external_id} from the provider in the next backfill pass, without waiting out its grace? Why:`, {
          action: "backfill_gap", tenant_id: g.tenant_id, source_id: g.source_id, external_id: g.external_id,
        })),
      " ",
      writeButton("Tombstone", { class: "tombstone", id: `tombstone-${i}` }, () =>
        change(`Declare ${g.external_id} never to arrive? Why:`, {
          action: "tombstone", tenant_id: g.tenant_id, source_id: g.source_id, external_id: g.external_id,
        })))));
  showIf(gen, 
    el("h1", {}, "Gaps"),
    el("p", { class: "muted" }, "Backfill fetches each from the provider once its grace has passed, every 5 minutes in AWS (hookctl backfill runs one pass). Backfill now: the next pass fetches it, grace or not."),
    table("gaps", ["source", "missing id", "sequence", "found", "grace", { label: "backfill tries", num: true }, "last error", "backfill asked", ""], rows),
    rows.length ? null : el("p", { class: "muted", id: "no-gaps" }, "No open gap."),
    el("p", { id: "action-outcome", class: "muted" }),
  );
}

// The outbox's failed messages: resent one by one or all at once.
async function outbox() {
  const gen = state.generation;
  let answer;
  try {
    answer = await ask({ action: "list_failed_outbox", filter: {} });
  } catch (error) {
    return showIf(gen, el("h1", {}, "Outbox"), failure(error));
  }
  const failed = answer.failed_outbox;
  const rows = failed.map((m, i) => el("tr", {},
    el("td", {}, m.outbox_id), el("td", {}, m.tenant_id),
    el("td", {}, el("a", { href: `#/event/${encodeURIComponent(m.tenant_id)}/${encodeURIComponent(m.external_id)}` }, m.external_id)),
    el("td", {}, m.action), el("td", { class: "num" }, m.attempts), el("td", {}, m.destination || "no route"),
    el("td", {}, m.last_error || ""),
    el("td", {}, writeButton("Resend", { class: "resend", id: `resend-${i}` }, () =>
      change(`Resend message ${m.outbox_id}? Why:`, { action: "resend_outbox", filter: { ids: [m.outbox_id] } })))));
  showIf(gen, 
    el("h1", {}, "Outbox: failed messages"),
    failed.length ? writeButton(`Resend all ${failed.length}`, { id: "resend-all" }, () =>
      change(`Resend ${failed.length} failed message(s)? Why:`, { action: "resend_outbox", filter: { ids: failed.map((m) => m.outbox_id) } })) : null,
    table("failed-outbox", ["id", "tenant", "event", "action", { label: "tries", num: true }, "destination", "last error", ""], rows),
    rows.length ? null : el("p", { class: "muted", id: "no-failed-outbox" }, "No failed message."),
    el("p", { id: "action-outcome", class: "muted" }),
  );
}

// The latest anomaly run: every check, breaching first, with what it measured; a check's
// name opens its history (#/checks/<name>/<subject>).
async function checkHelp() {
  if (!state.checkHelp) {
    const response = await fetch("/api/check-help", { credentials: "same-origin" });
    state.checkHelp = response.ok ? await response.json() : {};
  }
  return state.checkHelp;
}

async function checks() {
  const gen = state.generation;
  const opened = location.hash.match(/^#\/checks\/([^/]+)\/?(.*)$/);
  let answer, history, help;
  try {
    [answer, history, help] = await Promise.all([
      ask({ action: "list_checks" }),
      opened ? ask({ action: "check_history", check_name: decodeURIComponent(opened[1]),
        subject: decodeURIComponent(opened[2] || ""), runs: 48 }) : null,
      checkHelp(),
    ]);
  } catch (error) {
    return showIf(gen, el("h1", {}, "Checks"), failure(error));
  }
  const range = (c) => `${c.expected_low ?? "–"} … ${c.expected_high ?? "–"}`;
  const rows = answer.checks.map((c) => el("tr", { class: c.breached ? "breached" : null, "data-check": c.check_name },
    el("td", {}, c.breached ? "BREACHED" : "ok"),
    el("td", {}, el("a", { href: `#/checks/${encodeURIComponent(c.check_name)}/${encodeURIComponent(c.subject)}`, class: "check-link" }, c.check_name)),
    el("td", {}, c.family), el("td", {}, c.subject), el("td", { class: "num" }, c.value ?? "–"), el("td", {}, range(c)), el("td", {}, c.detail),
    el("td", { class: "muted" }, c.breached && help[c.check_name] ? help[c.check_name].do : "")));
  showIf(gen, 
    el("h1", {}, "Checks"),
    history ? checkHistory(history.check_history, help[decodeURIComponent(opened[1])]) : null,
    el("p", { class: "muted" }, answer.checks.length ? `measured ${age(answer.checks[0].measured_at)}` : "The anomaly job has not run yet."),
    table("checks", ["", "check", "family", "subject", { label: "value", num: true }, "expected", "what it says", "what to do (when breached)"], rows),
  );
}

// A check's values over its latest runs (oldest left), its expected range as a band, breaches red.
function checkHistory(results, help) {
  const runs = [...results].reverse();
  const name = runs.length ? `${runs[0].check_name}${runs[0].subject ? ` (${runs[0].subject})` : ""}` : "no run measured it";
  const svg = "http://www.w3.org/2000/svg";
  const width = 480, height = 80, step = width / Math.max(runs.length, 1);
  const values = runs.flatMap((r) => [r.value, r.expected_low, r.expected_high]).filter((v) => v !== null && Number.isFinite(v));
  const low = Math.min(0, ...values), high = Math.max(1, ...values);
  const y = (v) => height - 5 - ((v - low) / (high - low || 1)) * (height - 10);
  const node = document.createElementNS(svg, "svg");
  node.setAttribute("width", width);
  node.setAttribute("height", height);
  node.setAttribute("id", "check-history");
  runs.forEach((r, i) => {
    if (r.expected_low !== null || r.expected_high !== null) {
      const band = document.createElementNS(svg, "rect");
      const top = y(r.expected_high ?? high), bottom = y(r.expected_low ?? low);
      band.setAttribute("x", i * step);
      band.setAttribute("y", top);
      band.setAttribute("width", step);
      band.setAttribute("height", Math.max(1, bottom - top));
      band.setAttribute("fill", "#dff3e4");
      node.append(band);
    }
  });
  runs.forEach((r, i) => {
    if (r.value === null) return;
    const dot = document.createElementNS(svg, "circle");
    dot.setAttribute("cx", i * step + step / 2);
    dot.setAttribute("cy", y(r.value));
    dot.setAttribute("r", 3);
    dot.setAttribute("fill", r.breached ? "#b91c1c" : "#1d4ed8");
    dot.setAttribute("class", r.breached ? "breach" : "within");
    const title = document.createElementNS(svg, "title");
    title.textContent = `${new Date(r.measured_at).toLocaleString()}: ${r.value}${r.breached ? " (breached)" : ""}`;
    dot.append(title);
    node.append(dot);
  });
  return el("div", { id: "check" },
    el("h2", {}, `${name}: its last ${runs.length} run(s)`),
    node,
    el("p", { class: "muted" }, "Green: the range the check expects; red: a breach."),
    help ? el("p", { id: "check-means" }, el("strong", {}, "What it means: "), help.means)
      : el("p", { class: "muted", id: "check-means" }, "docs/operating.md has no text on this check."),
    help ? el("p", { id: "check-do" }, el("strong", {}, "What to do: "), help.do) : null);
}

// A job over dead letters: its estimate first, a confirmation and a reason, then the server
// runs it while the page shows its progress, with an abort.
async function startJob(kind, filter, all) {
  const verb = kind === "replay_dead_letters" ? "Replay" : "Discard";
  const outcome = document.getElementById("action-outcome");
  try {
    const { estimate } = await ask({ action: "estimate_job", kind, filter });
    if (!estimate) { outcome.textContent = "No open dead letter matches."; return; }
    if (!confirm(`${verb} ${estimate} dead letter(s)?`)) return;
    const reason = prompt(`${verb} ${estimate} dead letter(s): why?`);
    if (!reason) return;
    const { job } = await ask({ action: "start_job", kind, filter, all, reason });
    watchJob(job.job_id);
  } catch (err) {
    outcome.textContent = err.message;
  }
}

async function watchJob(jobId) {
  const panel = document.getElementById("job");
  let job;
  try {
    ({ job } = await ask({ action: "show_job", job_id: jobId }));
  } catch (err) {
    panel.replaceChildren(failure(err));
    return;
  }
  const taken = job.done + job.failed + job.skipped;
  panel.replaceChildren(...present([
    el("p", { id: "job-status", "data-status": job.status },
      `Job ${job.job_id} (${job.kind.replaceAll("_", " ")}): ${job.status}; `
      + `${job.done} done, ${job.failed} failed again, ${job.skipped} skipped, of ${job.estimate} estimated`),
    el("progress", { id: "job-progress", max: Math.max(job.estimate, taken, 1), value: taken }),
    job.status === "running" ? writeButton("Abort", { id: "abort-job" }, async () => {
      const reason = prompt(`Abort job ${job.job_id}? Why:`);
      if (!reason) return;
      try { await ask({ action: "abort_job", job_id: job.job_id, reason }); } catch (err) { alert(err.message); }
    }) : null,
  ]));
  if (job.status === "running") setTimeout(() => { if (document.getElementById("job")) watchJob(jobId); }, 1000);
}

// Dead letters, grouped by tenant, type and error; a group, or everything a filter matches, is
// replayed or discarded as a job.
async function deadLetters() {
  const gen = state.generation;
  let answer, jobs;
  try {
    [answer, { jobs }] = await Promise.all([
      ask({ action: "list_dead_letters", filter: {} }),
      ask({ action: "list_jobs", limit: 5 }),
    ]);
  } catch (error) {
    return showIf(gen, el("h1", {}, "Dead letters"), failure(error));
  }
  const groups = new Map();
  for (const d of answer.dead_letters) {
    const key = JSON.stringify([d.tenant_id, d.event_type, d.error]);
    if (!groups.has(key)) groups.set(key, []);
    groups.get(key).push(d);
  }
  const rows = [...groups.entries()].map(([key, letters], index) => {
    const [tenant, type, error] = JSON.parse(key);
    const ids = { ids: letters.map((d) => d.dead_letter_id) };
    return el("tr", { "data-group": index },
      el("td", {}, tenant), el("td", {}, type), el("td", {}, error),
      el("td", { class: "num" }, letters.length),
      el("td", {},
        writeButton("Replay group", { class: "replay-group", id: `replay-group-${index}` }, () =>
          startJob("replay_dead_letters", ids, false)),
        " ",
        writeButton("Discard group", { class: "discard-group", id: `discard-group-${index}` }, () =>
          startJob("discard_dead_letters", ids, false))));
  });
  const field = (name, label) => el("label", {}, label, el("input", { name, id: `letters-${name}` }));
  const filterForm = el("form", { class: "search", id: "letters-filter", onsubmit: (e) => e.preventDefault() },
    field("tenant_id", "tenant"), field("event_type", "event type"), field("error_contains", "error contains"),
    writeButton("Replay all matching", { id: "replay-matching", type: "button" }, () => {
      const { filter, all } = lettersFilter();
      startJob("replay_dead_letters", filter, all);
    }),
    writeButton("Discard all matching", { id: "discard-matching", type: "button" }, () => {
      const { filter, all } = lettersFilter();
      startJob("discard_dead_letters", filter, all);
    }));
  const recent = jobs.map((j) => el("tr", {},
    el("td", {}, j.job_id), el("td", {}, j.kind.replaceAll("_", " ")), el("td", {}, j.status),
    el("td", { class: "num" }, `${j.done + j.failed + j.skipped} / ${j.estimate}`), el("td", {}, j.actor), el("td", {}, j.reason)));
  showIf(gen, 
    el("h1", {}, "Dead letters"),
    table("dead-letters", ["tenant", "event type", "error", { label: "open", num: true }, ""], rows),
    rows.length ? null : el("p", { class: "muted", id: "no-dead-letters" }, "No open dead letter."),
    el("h2", {}, "Everything a filter matches (an empty filter: every open dead letter)"),
    filterForm,
    el("div", { id: "job" }),
    el("p", { id: "action-outcome", class: "muted" }),
    el("h2", {}, "Recent jobs"),
    recent.length ? table("jobs", ["job", "kind", "status", { label: "taken / estimate", num: true }, "actor", "reason"], recent)
      : el("p", { class: "muted" }, "none"),
  );
}

function lettersFilter() {
  const filter = {};
  for (const name of ["tenant_id", "event_type", "error_contains"]) {
    const value = document.getElementById(`letters-${name}`).value.trim();
    if (value) filter[name] = value;
  }
  return { filter, all: Object.keys(filter).length === 0 };
}

// The SQS buffer's dead letters: deliveries SQS took and the consumer could not file, never
// their bytes; redriven to the buffer's queue all at once.
async function buffer() {
  const gen = state.generation;
  let answer;
  try {
    answer = await ask({ action: "list_buffer_dead_letters", limit: 100 });
  } catch (error) {
    return showIf(gen, el("h1", {}, "The buffer's dead letters"), failure(error));
  }
  const letters = answer.buffer_dead_letters;
  const rows = letters.map((d) => el("tr", {},
    el("td", {}, d.source_id || "–"), el("td", {}, d.delivery_id || "–"),
    el("td", {}, d.received_at_micros ? new Date(d.received_at_micros / 1000).toLocaleString() : "–"),
    el("td", { class: "num" }, d.body_bytes ?? "–"), el("td", { class: "num" }, d.receive_count),
    el("td", {}, d.unreadable || "")));
  showIf(gen, 
    el("h1", {}, "The buffer's dead letters"),
    letters.length ? writeButton(`Redrive all ${letters.length}`, { id: "redrive-buffer" }, () =>
      change(`Send ${letters.length} delivery(ies) back to the buffer's queue? Why:`, { action: "redrive_buffer" })) : null,
    table("buffer-dead-letters", ["source", "delivery", "received", { label: "bytes", num: true },
      { label: "tries", num: true }, "not a delivery because"], rows),
    rows.length ? null : el("p", { class: "muted", id: "no-buffer-dead-letters" }, "None."),
    el("p", { id: "action-outcome", class: "muted" }),
  );
}

// Deliveries refused before anything was stored: what each source's add up to, then the latest.
async function refused() {
  const gen = state.generation;
  let answer;
  try {
    answer = await ask({ action: "list_refused", limit: 100 });
  } catch (error) {
    return showIf(gen, el("h1", {}, "Refused deliveries"), failure(error));
  }
  const summary = answer.last_day.map((s) => el("tr", { "data-source": s.source_id },
    el("td", {}, s.source_id), el("td", {}, s.check_failed), el("td", { class: "num" }, s.refused_last_day),
    el("td", {}, age(s.first_refused_at)), el("td", {}, age(s.last_refused_at)), el("td", {}, s.reading)));
  const latest = answer.refused.map((r) => el("tr", {},
    el("td", {}, new Date(r.refused_at).toLocaleString()), el("td", {}, r.source_id),
    el("td", { class: "num" }, r.status), el("td", {}, r.check_failed), el("td", {}, r.method),
    el("td", { class: "num" }, r.body_bytes), el("td", {}, r.user_agent || "–"),
    el("td", {}, r.header_names.join(", ")), el("td", { class: "num" }, r.also_refused), el("td", {}, r.detail)));
  showIf(gen, 
    el("h1", {}, "Refused deliveries"),
    el("p", { class: "muted" }, "Kept for known sources only, the newest 100 of each, at most one a second for a source and check (the others counted in +). Nothing of a body or a signature is kept."),
    el("h2", {}, "The last day"),
    summary.length ? table("refused-summary", ["source", "check", { label: "refused", num: true }, "first", "last", "reading"], summary)
      : el("p", { class: "muted", id: "refused-summary" }, "None in the last day."),
    el("h2", {}, "Latest"),
    table("refused", ["at", "source", { label: "status", num: true }, "check", "method", { label: "bytes", num: true },
      "user agent", "headers", { label: "+", num: true }, "detail"], latest),
  );
}

async function route() {
  clearTimeout(state.refresh);
  state.generation += 1;
  const hash = location.hash || "#/";
  for (const link of document.querySelectorAll("header nav a")) {
    link.classList.toggle("current", hash.startsWith(link.getAttribute("href")) && link.getAttribute("href") !== "#/" || hash === link.getAttribute("href"));
  }
  const eventPath = hash.match(/^#\/event\/([^/]+)\/(.+)$/);
  if (eventPath) return event(decodeURIComponent(eventPath[1]), decodeURIComponent(eventPath[2]));
  if (hash.startsWith("#/events")) return events();
  if (hash.startsWith("#/dead-letters")) return deadLetters();
  if (hash.startsWith("#/gaps")) return gaps();
  if (hash.startsWith("#/outbox")) return outbox();
  if (hash.startsWith("#/checks")) return checks();
  if (hash.startsWith("#/refused")) return refused();
  if (hash.startsWith("#/buffer")) return buffer();
  await overview();
  state.refresh = setTimeout(() => { if (!state.paused && (location.hash || "#/") === "#/") route(); }, 10000);
}

async function start() {
  const token = (location.hash.match(/token=([0-9a-f]+)/) || [])[1];
  if (token) {
    const response = await fetch("/session", {
      method: "POST", headers: { "content-type": "application/json" },
      body: JSON.stringify({ token }), credentials: "same-origin",
    });
    history.replaceState(null, "", "/#/");
    if (!response.ok) {
      const answer = await response.json().catch(() => ({}));
      return show(failure(new Error(answer.error || "this link does not open a session")));
    }
  }
  const who = await fetch("/api/whoami", { credentials: "same-origin" });
  if (!who.ok) return show(failure(new Error("no session: open the URL hookctl console printed")));
  state.whoami = await who.json();
  document.getElementById("mode").textContent = state.whoami.write
    ? `changes allowed, recorded as ${state.whoami.actor} (${state.whoami.backend})`
    : `read-only (${state.whoami.backend})`;
  window.addEventListener("hashchange", route);
  route();
}

start();
