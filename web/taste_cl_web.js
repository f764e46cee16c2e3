// taste_cl device learner for the browser: keep personalising an exported model with
// ONNX Runtime Web's deprecated training build (1.19.2), rehearsing the exported replay buffer, state kept in IndexedDB.
//
// Artifacts: a folder written by `taste-cl export` (taste_cl.adapters.onnxruntime.export followed by
// taste_cl.adapters.web.compat.make_web_compatible), described by its `web.json`.
//
//   import * as ort from './node_modules/onnxruntime-web-training/dist/ort.training.wasm.min.mjs';
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

import {
  ArtifactError, Random, Reservoir, checkFeatures, checkLabels, countCorrect, dbRequest, fetchBytes, ortCall, product, sha256Hex,
} from './taste_cl_common.js';

export { ArtifactError, Random, Reservoir, countCorrect };

const WEB_FORMAT = 1;

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

async function fetchChecked(base, name, files) {
  const bytes = await fetchBytes(new URL(name, base));
  if (!(name in files)) throw new ArtifactError(`web.json lists no SHA-256 for ${name}`);
  if ((await sha256Hex(bytes)) !== files[name]) {
    throw new ArtifactError(`artifact file ${name} is corrupt or was modified: SHA-256 mismatch`);
  }
  return bytes;
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

  features(x, what = 'x') { return checkFeatures(x, this.featureSize, this.inputShape, what); }

  labels(y, n) { return checkLabels(y, n, this.numClasses); }

  feeds(x, y) {
    const n = x.length / this.featureSize;
    return {
      [this.inputName]: new this.ort.Tensor('float32', x, [n, ...this.inputShape]),
      [this.labelName]: new this.ort.Tensor('int64', BigInt64Array.from(y, BigInt), [n]),
    };
  }

  /** The optimizer's name, as the page shows it. */
  get optimizerName() { return this.web.optimizer.type; }

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
