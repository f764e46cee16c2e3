// taste_cl device learner for the browser: keep personalising an exported model with
// ONNX Runtime Web training, rehearsing the exported replay buffer, state kept in IndexedDB.
//
// Artifacts: a folder written by `taste-cl export` (taste_cl.adapters.onnxruntime.export followed by
// taste_cl.adapters.web.compat.make_web_compatible), described by its `web.json`.
//
//   import * as ort from './node_modules/onnxruntime-web/dist/ort.training.wasm.min.mjs';
//   import { DeviceLearner } from './taste_cl_web.js';
//   const learner = await DeviceLearner.load('artifacts/', { ort });
//   const stats = await learner.observe(x, [3]);  // x: Float32Array of n * 64 features
//   const logits = await learner.predict(x);      // Float32Array of n * numClasses
//
// observe() mirrors the Python OrtOnlineLearner: score the batch (test-then-train), train
// `train_iterations` steps on it mixed with `replay_batch_size` buffered samples, then offer it
// to the reservoir. After each observe() the trainable parameters, the buffer, the counters and
// the random state are saved to IndexedDB under the artifacts' checkpoint digest, so a page
// reload resumes. The ORT Web API cannot read optimizer state: AdamW moments and step restart
// from the exported checkpoint's after a reload (SGD keeps no state, so it resumes exactly).
//
// Reserved class slots (`export(..., reserved_classes=K)`, web.json's `active_classes`): as in
// the Python learners (taste_cl/adapters/device/class_slots.py), a slot becomes active on its
// first label in observe() and stays active (saved with the learner); predict() and observe()'s
// accuracy give inactive slots the logit -Infinity. The training graph is the exported one:
// inactive slots take part in its softmax, as the unused outputs of a fixed-width head do.

const DB_NAME = 'taste_cl';
const STORE = 'learners';
const WEB_FORMAT = 1;

export class ArtifactError extends Error {}

/** Seedable 32-bit generator (mulberry32); its whole state is one integer, saved with the learner. */
export class Random {
  constructor(seed) { this.state = seed >>> 0; }
  next() {
    this.state = (this.state + 0x6d2b79f5) >>> 0;
    let t = this.state;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  }
}

/** Reservoir sampling (Vitter's algorithm R), like taste_cl.ReservoirReplay. */
export class Reservoir {
  constructor(capacity, featureSize, { seen = 0, x = null, y = [], random = new Random(0) } = {}) {
    this.capacity = capacity;
    this.featureSize = featureSize;
    this.x = new Float32Array(capacity * featureSize);
    if (x) this.x.set(x.subarray(0, y.length * featureSize));
    this.y = Array.from(y, Number);
    this.seen = seen;
    this.random = random;
  }
  get size() { return this.y.length; }

  add(x, y) {
    const f = this.featureSize;
    for (let i = 0; i < y.length; i += 1) {
      this.seen += 1;
      let slot = this.y.length;
      if (slot >= this.capacity) {
        slot = Math.floor(this.random.next() * this.seen);
        if (slot >= this.capacity) continue;
      }
      this.x.set(x.subarray(i * f, (i + 1) * f), slot * f);
      this.y[slot] = Number(y[i]);
    }
  }

  /** Up to `n` distinct stored samples, as {x, y}. */
  sample(n) {
    const order = Array.from({ length: this.size }, (_, i) => i);
    const k = Math.min(n, order.length);
    for (let i = 0; i < k; i += 1) {  // partial Fisher-Yates
      const j = i + Math.floor(this.random.next() * (order.length - i));
      [order[i], order[j]] = [order[j], order[i]];
    }
    const f = this.featureSize;
    const x = new Float32Array(k * f);
    const y = new Array(k);
    for (let i = 0; i < k; i += 1) {
      x.set(this.x.subarray(order[i] * f, (order[i] + 1) * f), i * f);
      y[i] = this.y[order[i]];
    }
    return { x, y };
  }
}

/** Which of `slots` output slots are active (`active` null: all, nothing masked), like the Python ClassSlots. */
export class ClassSlots {
  constructor(active, slots) {
    this.slots = slots;
    this.active = active === null ? null : new Set(active);
  }

  /** Check a web.json or saved `active_classes`: null, or increasing class indices in [0, slots). */
  static parse(value, slots, where) {
    if (value === null || value === undefined) return null;
    const valid = Array.isArray(value) && value.length > 0
      && value.every((c, i) => Number.isInteger(c) && c >= 0 && c < slots && (i === 0 || c > value[i - 1]));
    if (!valid) {
      const shown = JSON.stringify(value).slice(0, 80);
      throw new ArtifactError(`${where} active_classes must be null or a non-empty, increasing list of class indices in [0, ${slots}) (the output width); got ${shown}`);
    }
    return value;
  }

  /** Activate the slots of (validated) class `labels`; returns the newly active ones, sorted. */
  activate(labels) {
    if (this.active === null) return [];
    const added = [...new Set(labels)].filter((c) => !this.active.has(c)).sort((a, b) => a - b);
    added.forEach((c) => this.active.add(c));
    return added;
  }

  /** `logits` (n * slots floats) with -Infinity in the inactive slots (a copy; `logits` itself when none is). */
  mask(logits) {
    if (this.active === null || this.active.size === this.slots) return logits;
    const masked = Float32Array.from(logits);
    for (let c = 0; c < this.slots; c += 1) {
      if (this.active.has(c)) continue;
      for (let i = c; i < masked.length; i += this.slots) masked[i] = -Infinity;
    }
    return masked;
  }

  /** What the saved state keeps: the sorted active classes, or null when every slot always was. */
  toJSON() { return this.active === null ? null : [...this.active].sort((a, b) => a - b); }
}

async function fetchBytes(url) {
  const response = await fetch(url);
  if (!response.ok) throw new ArtifactError(`cannot fetch ${url}: HTTP ${response.status}`);
  return new Uint8Array(await response.arrayBuffer());
}

async function sha256Hex(bytes) {
  const digest = new Uint8Array(await crypto.subtle.digest('SHA-256', bytes));
  return Array.from(digest, (b) => b.toString(16).padStart(2, '0')).join('');
}

async function fetchChecked(base, name, files) {
  const bytes = await fetchBytes(new URL(name, base));
  if (!(name in files)) throw new ArtifactError(`web.json lists no SHA-256 for ${name}`);
  if ((await sha256Hex(bytes)) !== files[name]) {
    throw new ArtifactError(`artifact file ${name} is corrupt or was modified: SHA-256 mismatch`);
  }
  return bytes;
}

function openDb() {
  return new Promise((resolve, reject) => {
    const request = indexedDB.open(DB_NAME, 1);
    request.onupgradeneeded = () => request.result.createObjectStore(STORE);
    request.onsuccess = () => resolve(request.result);
    request.onerror = () => reject(request.error);
  });
}

async function dbRequest(mode, act) {
  const db = await openDb();
  try {
    return await new Promise((resolve, reject) => {
      const tx = db.transaction(STORE, mode);
      const request = act(tx.objectStore(STORE));
      tx.oncomplete = () => resolve(request.result);
      tx.onerror = () => reject(tx.error);
      tx.onabort = () => reject(tx.error);
    });
  } finally {
    db.close();
  }
}

function product(values) { return values.reduce((a, b) => a * b, 1); }

// The wasm build turns C++ exceptions into bare numbers; say what failed instead.
async function ortCall(what, promise) {
  try {
    return await promise;
  } catch (error) {
    const detail = error instanceof Error ? error.message : `wasm exception ${String(error)}`;
    throw new ArtifactError(`ONNX Runtime Web failed to ${what}: ${detail}`);
  }
}

export class DeviceLearner {
  constructor({ ort, session, web, reservoir, key, state }) {
    this.ort = ort;
    this.session = session;
    this.web = web;
    this.replay = reservoir;
    this.key = key;
    const input = web.inputs[0];
    this.inputName = input.name;
    this.inputShape = input.shape.slice(1).map(Number);
    this.featureSize = product(this.inputShape);
    this.labelName = web.labels.name;
    this.numClasses = web.num_classes;  // output slots, reserved ones included
    this.classes = new ClassSlots(state.activeClasses, web.num_classes);
    this.logitsName = web.outputs.logits;
    this.lossName = web.outputs.loss;
    this.replayBatchSize = web.batch_plan.replay_batch_size;
    this.trainIterations = web.batch_plan.train_iterations;
    this.lr = web.optimizer.lr;
    this.samplesSeen = state.samplesSeen;
    this.steps = state.steps;
    this.app = state.app;  // free-form data a page stores with the learner (e.g. a chart's history)
    this.resumed = state.resumed;
  }

  /**
   * Load the artifacts under `baseUrl` (verifying every SHA-256) and resume the state saved
   * in IndexedDB for them, unless `fresh` (then the saved state is discarded).
   */
  static async load(baseUrl, { ort, fresh = false, key = null } = {}) {
    if (!ort || !ort.TrainingSession) throw new ArtifactError('pass { ort } from onnxruntime-web/training');
    const base = new URL(baseUrl, globalThis.location ? globalThis.location.href : undefined);
    const webBytes = await fetchBytes(new URL('web.json', base));
    const web = JSON.parse(new TextDecoder().decode(webBytes));
    if (web.format !== WEB_FORMAT) {
      throw new ArtifactError(`web.json has format ${web.format}; this learner reads format ${WEB_FORMAT}`);
    }
    if (web.inputs.length !== 1 || web.inputs[0].dtype !== 'float32' || web.labels.dtype !== 'int64') {
      throw new ArtifactError('this learner trains one float32 input with int64 class labels');
    }
    const m = web.models;
    const [checkpoint, trainModel, evalModel, optimizerModel] = await Promise.all(
      [m.checkpoint, m.training, m.eval, m.optimizer].map((name) => fetchChecked(base, name, web.files)),
    );
    const session = await ortCall('load the artifacts', ort.TrainingSession.create(
      { checkpointState: checkpoint, trainModel, evalModel, optimizerModel },
      { executionProviders: ['wasm'] },
    ));
    const storageKey = key || web.files[m.checkpoint];
    if (fresh) await dbRequest('readwrite', (store) => store.delete(storageKey));
    const saved = fresh ? undefined : await dbRequest('readonly', (store) => store.get(storageKey));
    const featureSize = product(web.inputs[0].shape.slice(1).map(Number));
    const activeClasses = ClassSlots.parse(web.active_classes, web.num_classes, 'web.json');
    let reservoir = null;
    let state = { samplesSeen: web.counters.samples_seen, steps: web.counters.steps, app: {}, resumed: false, activeClasses };
    if (saved) {
      await ortCall('restore saved parameters', session.loadParametersBuffer(new Uint8Array(saved.params.buffer), true));
      if (saved.replay) {
        const r = saved.replay;
        reservoir = new Reservoir(r.capacity, featureSize, { seen: r.seen, x: r.x, y: r.y, random: new Random(r.random) });
      }
      state = {
        samplesSeen: saved.samplesSeen,
        steps: saved.steps,
        app: saved.app || {},
        resumed: true,
        // a state saved before slots were tracked has none: the artifacts' list
        activeClasses: saved.activeClasses === undefined ? activeClasses : ClassSlots.parse(saved.activeClasses, web.num_classes, 'saved'),
      };
    } else if (web.replay) {
      const r = web.replay;
      const bytes = await fetchChecked(base, r.file, web.files);
      const buffer = bytes.buffer.slice(bytes.byteOffset, bytes.byteOffset + bytes.byteLength);
      const x = new Float32Array(buffer, r.arrays.x.offset, r.arrays.x.nbytes / 4);
      const y = new BigInt64Array(buffer, r.arrays.y.offset, r.size);
      // the reservoir continues from the exported one; its random stream is seeded from it
      reservoir = new Reservoir(r.capacity, featureSize, { seen: r.seen, x, y, random: new Random(r.seed * 1000003 + r.seen) });
    }
    return new DeviceLearner({ ort, session, web, reservoir, key: storageKey, state });
  }

  features(x, what = 'x') {
    const data = x instanceof Float32Array ? x : Float32Array.from(x);
    if (data.length === 0 || data.length % this.featureSize !== 0) {
      throw new RangeError(`${what} has ${data.length} values, must be a positive multiple of ${this.featureSize} (shape ${this.inputShape})`);
    }
    const bad = data.reduce((count, v) => count + (Number.isFinite(v) ? 0 : 1), 0);
    if (bad) throw new RangeError(`${what} contains ${bad} non-finite value(s) (NaN or inf)`);
    return data;
  }

  labels(y, n) {
    const labels = Array.from(y, Number);
    if (labels.length !== n) throw new RangeError(`y has ${labels.length} labels for ${n} samples`);
    for (const label of labels) {
      if (!Number.isInteger(label) || label < 0 || label >= this.numClasses) {
        throw new RangeError(`label ${label} is not a class index in [0, ${this.numClasses})`);
      }
    }
    return labels;
  }

  feeds(x, y) {
    const n = x.length / this.featureSize;
    return {
      [this.inputName]: new this.ort.Tensor('float32', x, [n, ...this.inputShape]),
      [this.labelName]: new this.ort.Tensor('int64', BigInt64Array.from(y, BigInt), [n]),
    };
  }

  /** One optimizer step on `x` (n * featureSize floats) and `y` (n labels): {loss, logits, skipped}. */
  async trainStep(x, y) {
    const features = this.features(x);
    const labels = this.labels(y, features.length / this.featureSize);
    const out = await ortCall('run a training step', this.session.runTrainStep(this.feeds(features, labels)));
    const loss = Number(out[this.lossName].data[0]);
    const skipped = !Number.isFinite(loss);  // as the Python learner, never step on a non-finite loss
    if (!skipped) await ortCall('run the optimizer step', this.session.runOptimizerStep());
    await this.session.lazyResetGrad();
    return { loss, logits: out[this.logitsName].data, skipped };
  }

  /** Logits (n * numClasses floats) from the eval graph (reserved slots not yet in use: -Infinity); changes no state. */
  async predict(x) {
    const features = this.features(x);
    const n = features.length / this.featureSize;
    const out = await ortCall('run the eval graph', this.session.runEvalStep(this.feeds(features, new Array(n).fill(0))));
    return this.classes.mask(out[this.logitsName].data);
  }

  /** Test-then-train on one batch with replay, then save to IndexedDB; returns the step's stats. */
  async observe(x, y) {
    const features = this.features(x);
    const n = features.length / this.featureSize;
    const labels = this.labels(y, n);
    this.classes.activate(labels);  // a reserved slot is in use from its first label on
    const start = performance.now();
    const nReplay = this.replay ? Math.min(this.replayBatchSize, this.replay.size) : 0;
    let lossSum = 0;
    let steps = 0;
    let correct = 0;
    for (let iteration = 0; iteration < this.trainIterations; iteration += 1) {
      let trainX = features;
      let trainY = labels;
      if (nReplay) {
        const rehearsal = this.replay.sample(nReplay);
        trainX = new Float32Array(features.length + rehearsal.x.length);
        trainX.set(features);
        trainX.set(rehearsal.x, features.length);
        trainY = labels.concat(rehearsal.y);
      }
      const { loss, logits, skipped } = await this.trainStep(trainX, trainY);
      if (iteration === 0) correct = countCorrect(this.classes.mask(logits), labels, this.numClasses);
      steps += skipped ? 0 : 1;
      lossSum += loss;
    }
    const elapsed = performance.now() - start;
    if (this.replay) this.replay.add(features, labels);
    this.samplesSeen += n;
    this.steps += 1;
    await this.save();
    return {
      loss: lossSum / this.trainIterations,
      accuracy: correct / n,
      samples: n,
      replaySamples: nReplay * this.trainIterations,
      steps,
      stepTimeMs: elapsed,
      skipped: steps < this.trainIterations,
    };
  }

  /** Save parameters, buffer, counters, active classes and `app` data to IndexedDB (observe() calls it). */
  async save() {
    const params = await ortCall('read the parameters', this.session.getContiguousParameters(true));
    const data = params.data ?? params[2];
    const r = this.replay;
    const record = {
      params: new Float32Array(data),
      replay: r && { capacity: r.capacity, seen: r.seen, x: r.x.slice(0, r.size * r.featureSize), y: r.y.slice(), random: r.random.state },
      samplesSeen: this.samplesSeen,
      steps: this.steps,
      activeClasses: this.classes.toJSON(),
      app: this.app,
    };
    await dbRequest('readwrite', (store) => store.put(record, this.key));
  }

  /** Forget the saved state (the next load starts from the artifacts again). */
  async forget() {
    await dbRequest('readwrite', (store) => store.delete(this.key));
  }

  async release() {
    await this.session.release();
  }
}

export function countCorrect(logits, labels, numClasses) {
  let correct = 0;
  labels.forEach((label, i) => {
    let best = 0;
    for (let c = 1; c < numClasses; c += 1) {
      if (logits[i * numClasses + c] > logits[i * numClasses + best]) best = c;
    }
    correct += best === label ? 1 : 0;
  });
  return correct;
}
