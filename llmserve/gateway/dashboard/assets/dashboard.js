// The gateway's live page: polls dashboard/data (docs/dashboard.md) and draws it with
// uPlot. The API key, when the gateway wants one, comes from this page's URL fragment
// (#key=...), which the browser never sends to a server, and goes out only as the
// JSON request's Authorization header.
"use strict";

(function () {
  const POLL_MS = 1500;
  const DATA_URL = "dashboard/data?step=5";  // 5-second points: steadier rates and percentiles
  const state = { charts: {}, last: null, polls: 0, failures: 0 };
  window.llmserveDashboard = state;  // for tests and for poking at in the console

  function apiKey() {
    return new URLSearchParams(location.hash.slice(1)).get("key") || "";
  }

  // --- formatting ----------------------------------------------------------------------
  const fmt = {
    num: (v, d = 1) => (v == null ? "–" : Number(v).toFixed(d)),
    pct: (v) => (v == null ? "–" : (100 * v).toFixed(1) + " %"),
    secs: (v) => (v == null ? "–" : v < 1 ? (1000 * v).toFixed(0) + " ms" : v.toFixed(2) + " s"),
  };

  function el(tag, text, cls) {
    const e = document.createElement(tag);
    if (text !== undefined) e.textContent = text;
    if (cls) e.className = cls;
    return e;
  }

  // --- charts --------------------------------------------------------------------------
  const PALETTE = ["#0969da", "#bf8700", "#cf222e", "#1a7f37", "#8250df"];

  // Each chart: its element, its series (label, column of data.series, scale factor).
  const CHARTS = {
    rate: ["chart-rate", [["requests", "requests_per_s"], ["5xx", "errors_per_s"]]],
    ttft: ["chart-ttft", [["p50", "ttft_p50"], ["p90", "ttft_p90"], ["p99", "ttft_p99"]]],
    itl: ["chart-itl", [["p50", "itl_p50"], ["p90", "itl_p90"], ["p99", "itl_p99"]]],
    queue: ["chart-queue", [["running", "running"], ["waiting", "waiting"]]],
    cache: ["chart-cache", [["KV use", "kv_usage", 100],
                            ["prefix hits", "prefix_cache_hit_rate", 100]]],
  };

  function chartWidth(node) {
    return Math.max(300, node.clientWidth || node.parentNode.clientWidth - 12);
  }

  function makeChart(name, series) {
    const [id, columns] = CHARTS[name];
    const node = document.getElementById(id);
    const opts = {
      width: chartWidth(node),
      height: 180,
      scales: { x: { time: true } },
      legend: { live: false },
      cursor: { show: true },
      series: [{}].concat(columns.map(([label], i) => ({
        label, stroke: PALETTE[i], width: 1.5, spanGaps: true, points: { size: 4 },
      }))),
    };
    return new uPlot(opts, chartData(name, series), node);
  }

  function chartData(name, series) {
    const columns = CHARTS[name][1];
    return [series.t].concat(columns.map(([, key, scale]) =>
      series[key].map((v) => (v == null ? null : v * (scale || 1)))));
  }

  function drawCharts(series) {
    for (const name of Object.keys(CHARTS)) {
      if (!state.charts[name]) state.charts[name] = makeChart(name, series);
      else state.charts[name].setData(chartData(name, series));
    }
  }

  window.addEventListener("resize", () => {
    for (const [name, chart] of Object.entries(state.charts)) {
      chart.setSize({ width: chartWidth(document.getElementById(CHARTS[name][0])),
                      height: 180 });
    }
  });

  // --- tiles and tables ----------------------------------------------------------------
  function drawTiles(data) {
    const s = data.summary;
    const tiles = [
      ["requests / s (1 min)", fmt.num(s.requests_per_s, 2)],
      ["5xx (1 min)", String(s.errors)],
      ["TTFT p50 / p99", fmt.secs(s.ttft.p50) + " / " + fmt.secs(s.ttft.p99)],
      ["ITL p50 / p99", fmt.secs(s.itl.p50) + " / " + fmt.secs(s.itl.p99)],
      ["prefix-cache hits (1 min)", fmt.pct(s.prefix_cache_hit_rate)],
      ["in flight", String(data.gateway.in_flight)],
      ["queued at the gateway", String(data.gateway.queued)],
      ["engines ready", data.engines.filter((e) => e.state === "ready").length +
        " / " + data.engines.length],
    ];
    const box = document.getElementById("tiles");
    box.replaceChildren(...tiles.map(([k, v]) => {
      const t = el("div", undefined, "tile");
      t.append(el("div", v, "v"), el("div", k, "k"));
      return t;
    }));
  }

  function fillTable(id, rows) {
    document.querySelector("#" + id + " tbody").replaceChildren(...rows.map((cells) => {
      const tr = el("tr");
      for (const c of cells) tr.append(Array.isArray(c) ? el("td", c[0], c[1]) : el("td", c));
      return tr;
    }));
  }

  function drawEngines(engines) {
    fillTable("engines", engines.map((e) => [
      e.url, e.role, [e.state, e.state], String(e.in_flight), fmt.num(e.running, 0),
      fmt.num(e.waiting, 0), fmt.pct(e.kv_usage), fmt.pct(e.prefix_cache_hit_rate),
    ]));
  }

  function drawTenants(tenants) {
    document.getElementById("tenants-section").hidden = !tenants;
    if (!tenants) return;
    fillTable("tenants", tenants.map((t) => [
      t.name, fmt.num(t.weight, 2), fmt.pct(t.weight_share), fmt.pct(t.token_share),
      String(t.tokens), String(t.requests), String(t.throttled), String(t.queued),
      String(t.in_flight),
    ]));
  }

  // --- polling -------------------------------------------------------------------------
  function setStatus(text, bad) {
    const s = document.getElementById("status");
    s.textContent = text;
    s.classList.toggle("bad", !!bad);
  }

  function askForKey() {
    const form = document.getElementById("key-form");
    form.hidden = false;
    form.onsubmit = (ev) => {
      ev.preventDefault();
      location.hash = "key=" + encodeURIComponent(document.getElementById("key-input").value);
      form.hidden = true;
      poll();
    };
  }

  async function poll() {
    const headers = {};
    const key = apiKey();
    if (key) headers.Authorization = "Bearer " + key;
    try {
      const r = await fetch(DATA_URL, { headers, cache: "no-store" });
      if (r.status === 401) {
        setStatus("needs an API key", true);
        askForKey();
        return;  // polling resumes once a key is given
      }
      if (!r.ok) throw new Error("HTTP " + r.status);
      const data = await r.json();
      state.last = data;
      state.polls += 1;
      document.getElementById("window").textContent = String(data.window_s / 60);
      document.getElementById("step").textContent = String(data.step_s);
      drawTiles(data);
      drawCharts(data.series);
      drawEngines(data.engines);
      drawTenants(data.tenants);
      setStatus("updated " + new Date(data.time * 1000).toLocaleTimeString());
    } catch (e) {
      state.failures += 1;
      setStatus("gateway unreachable (" + e.message + "); retrying", true);
    }
    setTimeout(poll, POLL_MS);
  }

  window.addEventListener("hashchange", () => {
    document.getElementById("key-form").hidden = true;
  });
  poll();
})();
