// Demo page: an 8x8 drawing pad (the sklearn digits resolution, upscaled), the model's prediction,
// and one button per class; pressing one personalizes the model on the drawing (with replay).
// Query parameters: artifacts=URL of the artifact folder (default /artifacts/), fresh=1 to
// discard the state saved in IndexedDB. The folder's web.json names the learner: the ONNX engine's
// (taste_cl_engine.js, current onnxruntime-web) or the deprecated training build's (taste_cl_web.js).
import { countCorrect } from '/web/taste_cl_common.js';

const ENGINE_FORMAT = 'taste_cl.web_engine/1';
const LEARNERS = {
  engine: ['/web/node_modules/onnxruntime-web/dist/ort.wasm.min.mjs', '/web/taste_cl_engine.js', 'EngineLearner'],
  training: ['/web/node_modules/onnxruntime-web-training/dist/ort.training.wasm.min.mjs', '/web/taste_cl_web.js', 'DeviceLearner'],
};

const GRID = 8;
const pad = document.getElementById('pad');
const cell = pad.width / GRID;
const pixels = new Float32Array(GRID * GRID);
const params = new URLSearchParams(location.search);

function drawPad() {
  const ctx = pad.getContext('2d');
  for (let i = 0; i < pixels.length; i += 1) {
    const v = Math.round(255 * (1 - pixels[i]));
    ctx.fillStyle = `rgb(${v},${v},${v})`;
    ctx.fillRect((i % GRID) * cell, Math.floor(i / GRID) * cell, cell, cell);
  }
}

function ink(event) {
  const rect = pad.getBoundingClientRect();
  const cx = ((event.clientX - rect.left) / rect.width) * GRID - 0.5;
  const cy = ((event.clientY - rect.top) / rect.height) * GRID - 0.5;
  for (let r = 0; r < GRID; r += 1) {
    for (let c = 0; c < GRID; c += 1) {
      const d2 = (c - cx) ** 2 + (r - cy) ** 2;
      pixels[r * GRID + c] = Math.min(1, pixels[r * GRID + c] + 0.35 * Math.exp(-d2 / 0.5));
    }
  }
  drawPad();
}

function softmax(logits) {
  const top = Math.max(...logits);
  const e = Array.from(logits, (v) => Math.exp(v - top));
  const s = e.reduce((a, b) => a + b, 0);
  return e.map((v) => v / s);
}

function drawChart(history) {
  const canvas = document.getElementById('chart');
  const ctx = canvas.getContext('2d');
  const { width: w, height: h } = canvas;
  ctx.clearRect(0, 0, w, h);
  ctx.strokeStyle = '#ddd';
  ctx.strokeRect(0, 0, w, h);
  ctx.fillStyle = '#888';
  ctx.font = '10px sans-serif';
  ctx.fillText('1.0', 2, 10);
  ctx.fillText('0.0', 2, h - 3);
  if (!history.length) return;
  const x = (i) => 22 + ((w - 30) * i) / Math.max(1, history.length - 1);
  const y = (v) => h - 6 - (h - 14) * v;
  const series = [[[], '#4a7fd0', 'running'], [[], '#e07b39', 'last 5']];
  let hits = 0;
  history.forEach((hit, i) => {
    hits += hit;
    const recent = history.slice(Math.max(0, i - 4), i + 1);
    series[0][0].push(hits / (i + 1));
    series[1][0].push(recent.reduce((a, b) => a + b, 0) / recent.length);
  });
  series.forEach(([values, color, name], k) => {
    ctx.strokeStyle = color;
    ctx.lineWidth = 2;
    ctx.beginPath();
    values.forEach((v, i) => (i ? ctx.lineTo(x(i), y(v)) : ctx.moveTo(x(i), y(v))));
    ctx.stroke();
    ctx.fillStyle = color;
    ctx.fillText(name, w - 60, 12 + 12 * k);
  });
}

const demo = {
  learner: null,
  lastPrediction: null,
  async predictDrawing() {
    const logits = await demo.learner.predict(pixels);
    const probs = softmax(logits);
    const best = probs.indexOf(Math.max(...probs));
    demo.lastPrediction = best;
    document.getElementById('prediction').textContent = pixels.some((v) => v > 0) ? String(best) : '–';
    document.getElementById('bars').innerHTML = probs
      .map((p, c) => `<span>${c}</span><div class="bar" style="width:${Math.round(100 * p)}px"></div>`).join('');
    return { logits: Array.from(logits), label: best };
  },
  setPixels(values) {
    pixels.set(values);
    drawPad();
    return demo.predictDrawing();
  },
  clear() {
    pixels.fill(0);
    drawPad();
    return demo.predictDrawing();
  },
  async correct(label) {
    const { learner } = demo;
    const before = await learner.predict(pixels);
    const hit = countCorrect(before, [label], learner.numClasses);
    learner.app.history = [...(learner.app.history || []), hit];
    const stats = await learner.observe(pixels, [label]);
    drawChart(learner.app.history);
    showStatus();
    await demo.predictDrawing();
    return stats;
  },
};

function showStatus() {
  const l = demo.learner;
  const replay = l.replay ? `${l.replay.size}/${l.replay.capacity}` : 'none';
  document.getElementById('status').textContent =
    `${l.optimizerName} lr=${l.lr} · samples seen ${l.samplesSeen} · replay ${replay} · ` +
    `corrections ${(l.app.history || []).length}${l.resumed ? ' · resumed from this browser' : ''}`;
}

async function start() {
  const artifacts = params.get('artifacts') || '/artifacts/';
  const response = await fetch(new URL('web.json', new URL(artifacts, location.href)));
  const format = response.ok ? (await response.json()).format : null;
  const [bundle, module, name] = LEARNERS[format === ENGINE_FORMAT ? 'engine' : 'training'];
  const ort = await import(bundle);
  ort.env.wasm.numThreads = 1;  // threads need cross-origin isolation; one is plenty for small models
  const Learner = (await import(module))[name];
  demo.learner = await Learner.load(artifacts, { ort, fresh: params.get('fresh') === '1' });
  if (params.has('fresh')) {  // start fresh once: a later reload resumes what this visit learned
    params.delete('fresh');
    history.replaceState(null, '', `${location.pathname}?${params}`);
  }
  const labels = document.getElementById('labels');
  for (let c = 0; c < demo.learner.numClasses; c += 1) {
    const button = document.createElement('button');
    button.textContent = String(c);
    button.onclick = async () => { await demo.correct(c); await demo.clear(); };
    labels.appendChild(button);
  }
  let drawing = false;
  pad.addEventListener('pointerdown', (e) => { drawing = true; ink(e); });
  pad.addEventListener('pointermove', (e) => drawing && ink(e));
  window.addEventListener('pointerup', () => { if (drawing) { drawing = false; demo.predictDrawing(); } });
  document.getElementById('clear').onclick = () => demo.clear();
  document.getElementById('reset').onclick = async () => { await demo.learner.forget(); location.reload(); };
  drawPad();
  drawChart(demo.learner.app.history || []);
  showStatus();
  await demo.predictDrawing();
}

window.demo = demo;
window.demoReady = start().then(
  () => { document.body.dataset.state = 'ready'; },
  (error) => { document.body.dataset.state = 'error'; document.getElementById('status').textContent = String(error); throw error; },
);
