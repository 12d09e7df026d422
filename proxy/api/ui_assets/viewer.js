// The trajectory viewer: sessions on the left, the chosen session's tree of turns, and one
// trajectory's tokens. Everything the model wrote is inserted as text, never as markup.
"use strict";

const state = { trial: null, leaf: null, turns: [], trajectories: [], agents: [], shownTurns: -1 };

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value);
  }
  for (const child of children) node.append(child);
  return node;
}

async function getJSON(path) {
  const response = await fetch(path, { credentials: "same-origin" });
  if (response.status === 401) {
    window.location.reload(); // signed out: the page turns into the login form
    throw new Error("signed out");
  }
  if (!response.ok) throw new Error(`${path}: ${response.status}`);
  return response.json();
}

function setStatus(text) {
  document.getElementById("status").textContent = text;
}

async function refreshSessions() {
  const data = await getJSON("/ui/api/sessions");
  const list = document.getElementById("session-list");
  list.replaceChildren(
    ...data.sessions.map((s) =>
      el(
        "li",
        {
          class: s.trial_id === state.trial ? "active" : "",
          "data-trial": s.trial_id,
          onclick: () => openSession(s.trial_id),
        },
        el("div", { class: "id", text: s.trial_id }),
        el("div", {
          class: "meta",
          text: `${s.status} · ${s.turns} turns · ${s.branches} branches` +
            (s.reward === null ? "" : ` · reward ${JSON.stringify(s.reward)}`),
        }),
      ),
    ),
  );
  setStatus(`${data.sessions.length} sessions · updated ${new Date().toLocaleTimeString()}`);
}

function turnBox(turn) {
  const badges = [
    el("span", { class: "badge branch", text: turn.branch_reason }),
    el("span", { class: "badge" + (turn.finish_reason === "length" ? " cut" : ""), text: `finish ${turn.finish_reason}` }),
  ];
  if (turn.capped) badges.push(el("span", { class: "badge cut", text: "capped" }));
  if (turn.truncated) badges.push(el("span", { class: "badge cut", text: "client left" }));
  // A reply the agent never received is not trained (unless kept on purpose).
  if (turn.delivered === false) badges.push(el("span", { class: "badge cut", text: "not delivered" }));
  if (turn.retry_of !== null && turn.retry_of !== undefined) {
    badges.push(el("span", { class: "badge branch", text: `retry of #${turn.retry_of}` }));
  }
  if (turn.replays) badges.push(el("span", { class: "badge branch", text: `replayed ×${turn.replays}` }));
  if (turn.agent && (turn.agent !== "main" || turn.agent_kind !== "main")) {
    badges.push(el("span", { class: "badge", text: `agent ${turn.agent} (${turn.agent_kind})` }));
  }
  const facts = [
    `${turn.completion_tokens} sampled / ${turn.prompt_tokens} prompt`,
    `worker ${turn.worker_id || "?"}`,
    turn.policy_versions && turn.policy_versions.length
      ? `policy ${turn.policy_versions.map((v) => `v${v}`).join("→")}`
      : "no policy version",
    `queue ${turn.queue_seconds}s · engine ${turn.engine_seconds}s`,
  ];
  if (turn.tool_calls) facts.push(`${turn.tool_calls} tool call(s)`);
  return el(
    "div",
    {
      class: "turn",
      "data-turn": String(turn.turn),
      title: `${turn.api} · ${turn.model}`,
      onclick: (event) => {
        event.stopPropagation();
        showTrajectoryThrough(turn.turn);
      },
    },
    el("span", { class: "n", text: `#${turn.turn}` }),
    ...badges,
    el("span", { class: "facts", text: facts.join(" · ") }),
  );
}

function renderTree() {
  const children = new Map();
  for (const turn of state.turns) {
    const key = turn.parent === null ? "root" : turn.parent;
    if (!children.has(key)) children.set(key, []);
    children.get(key).push(turn);
  }
  const branch = (key) => {
    const kids = children.get(key) || [];
    if (!kids.length) return null;
    return el(
      "ul",
      {},
      ...kids.map((turn) => {
        const sub = branch(turn.turn);
        return el("li", {}, turnBox(turn), ...(sub ? [sub] : []));
      }),
    );
  };
  const tree = document.getElementById("tree");
  tree.replaceChildren(branch("root") || el("p", { class: "hint", text: "No turns yet." }));
  renderAgents();
  markSelection();
}

// The agents as a tree by parent: each with its kind, its turns and the call that spawned it.
function renderAgents() {
  const children = new Map();
  for (const agent of state.agents) {
    const key = agent.parent ?? "";
    if (!children.has(key)) children.set(key, []);
    children.get(key).push(agent);
  }
  const seen = new Set();
  const branch = (key) => {
    const kids = (children.get(key) || []).filter((a) => !seen.has(a));
    if (!kids.length) return null;
    return el(
      "ul",
      {},
      ...kids.map((agent) => {
        seen.add(agent);
        const spawned = agent.spawned_by
          ? ` · spawned by #${agent.spawned_by.turn} (${agent.spawned_by.tool_call_id})`
          : "";
        const turns = agent.turns.map((t) => `#${t}`).join(" ");
        const sub = agent.kind === "main" || agent.kind === "subagent" ? branch(agent.id) : null;
        return el(
          "li",
          {},
          el("div", { class: "agent", text: `${agent.id} (${agent.kind}) · ${turns}${spawned}` }),
          ...(sub ? [sub] : []),
        );
      }),
    );
  };
  document.getElementById("agents").replaceChildren(
    el("h3", { text: "Agents" }),
    branch("") || el("p", { class: "hint", text: "No agents yet." }),
  );
}

function markSelection() {
  const path = new Set(
    (state.trajectories.find((t) => t.leaf === state.leaf) || { turns: [] }).turns,
  );
  for (const box of document.querySelectorAll(".turn")) {
    box.classList.toggle("selected", path.has(Number(box.dataset.turn)));
  }
}

function logprobColour(lp) {
  // 0 → green, -5 or below → red
  const hue = Math.round(120 * Math.max(0, 1 + lp / 5));
  return `hsl(${hue} 70% 80%)`;
}

async function showTrajectory(leaf) {
  state.leaf = leaf;
  markSelection();
  const data = await getJSON(
    `/ui/api/sessions/${encodeURIComponent(state.trial)}/trajectories/${leaf}`,
  );
  if (state.leaf !== leaf) return;
  const starts = new Set(data.turns.map((t) => t.start));
  // An image's placeholder tokens are shown as the image: a thumbnail at its first token.
  const images = new Map((data.images || []).map((image) => [image.start, image]));
  let skipTo = 0;
  const placed = (at) => {
    const image = images.get(at);
    if (image) {
      skipTo = image.end;
      spans.push(el("img", {
        class: "thumb",
        src: image.url,
        alt: `image ${image.width}×${image.height}`,
        title: `image ${image.width}×${image.height} · ${image.end - image.start} tokens`,
      }));
    }
    return at < skipTo;
  };
  const spans = [];
  data.prompt.forEach(([text, id], at) => {
    if (placed(at)) return;
    spans.push(el("span", { class: "tok prompt", title: `prompt · id ${id}`, text }));
  });
  data.response.forEach(([text, id, mask, lp], at) => {
    if (placed(data.prompt.length + at)) return;
    const classes = ["tok", mask ? "sampled" : "ctx"];
    if (starts.has(at) && mask) classes.push("turn-start");
    const attrs = {
      class: classes.join(" "),
      title: mask ? `sampled · id ${id} · logprob ${lp}` : `context · id ${id}`,
      text,
    };
    if (mask) attrs.style = `background: ${logprobColour(lp)}`;
    spans.push(el("span", attrs));
  });
  document.getElementById("tokens").replaceChildren(...spans);
  document.getElementById("legend").hidden = false;
}

function showTrajectoryThrough(turn) {
  const found = state.trajectories.find((t) => t.turns.includes(turn));
  if (found) showTrajectory(found.leaf);
}

async function refreshSession() {
  if (!state.trial) return;
  const data = await getJSON(`/ui/api/sessions/${encodeURIComponent(state.trial)}`);
  if (data.trial_id !== state.trial) return;
  state.turns = data.turns;
  state.trajectories = data.trajectories;
  state.agents = data.agents || [];
  const head = document.getElementById("session-head");
  head.replaceChildren(
    el("span", { class: "id", text: data.trial_id }),
    document.createTextNode(
      ` · ${data.status} · model ${data.model ?? "any"} · history ${data.options.history}` +
        ` · ${data.turns.length} turns · ${data.trajectories.length} trajectories` +
        (data.reward === null ? "" : ` · reward ${JSON.stringify(data.reward)}`),
    ),
  );
  if (data.turns.length !== state.shownTurns) {
    state.shownTurns = data.turns.length;
    renderTree();
    const leaves = data.trajectories.map((t) => t.leaf);
    if (state.leaf === null || !leaves.includes(state.leaf)) {
      // the trajectory with the newest turn
      if (leaves.length) await showTrajectory(Math.max(...leaves));
    } else {
      await showTrajectory(state.leaf);
    }
  }
}

async function openSession(trial) {
  state.trial = trial;
  state.leaf = null;
  state.shownTurns = -1;
  document.querySelector(".hint").hidden = true;
  for (const li of document.querySelectorAll("#session-list li")) {
    li.classList.toggle("active", li.dataset.trial === trial);
  }
  const url = new URL(window.location);
  url.hash = trial;
  history.replaceState(null, "", url);
  await refreshSession();
}

async function tick() {
  try {
    await refreshSessions();
    await refreshSession();
  } catch (error) {
    setStatus(`error: ${error.message}`);
  }
}

(async () => {
  await tick();
  const wanted = decodeURIComponent(window.location.hash.slice(1));
  if (wanted) await openSession(wanted);
  setInterval(tick, 2000); // live: new sessions and turns appear as they are recorded
})();
