// taste_cl device learner for the browser on current ONNX Runtime Web: the ONNX engine's standard graphs
// (forward.onnx, backward.onnx, optimizer.onnx) run as plain InferenceSessions; the loop is here, in JS.
//
// Artifacts: a folder written by taste_cl.adapters.web.engine_web.export_web from an onnx_engine folder
// (`learner.export(folder, backend="onnx_engine")` or `export_engine`), described by its web.json.
//
//   import * as ort from './node_modules/onnxruntime-web/dist/ort.wasm.min.mjs';
//   import { EngineLearner } from './taste_cl_engine.js';
//   const learner = await EngineLearner.load('artifacts/', { ort });
//   const stats = await learner.observe(x, [3]);  // x: Float32Array of n * 64 features
//   const logits = await learner.predict(x);      // Float32Array of n * numClasses
//
// One step, as the Python engine loop (taste_cl/engine/loop.py) with plain experience replay:
// forward.onnx on [stream | replay] rows (the graphs' fixed batch: chunks, the last padded with its first
// row), mean cross-entropy and its gradient with respect to the outputs (taste_cl/engine/losses.py),
// backward.onnx (padded rows get a zero gradient), clipping to max_grad_norm (torch's definition), then
// optimizer.onnx under the device update guard (taste_cl/guards/device.py and size_rule.py): a non-finite
// loss or gradient is skipped; a step that may be unusual is measured and undone (parameters and optimizer
// state restored) when it is too large. Every file's size and SHA-256 are checked before it is used.
// After each observe() the parameters, the optimizer state, the buffer, the guard's history and the
// counters are saved to IndexedDB (keyed by web.json's SHA-256), so a reload resumes exactly.

import {
  ArtifactError, Random, Reservoir, checkFeatures, checkLabels, countCorrect, dbRequest, fetchBytes, ortCall, product, sha256Hex,
} from './taste_cl_common.js';

export { ArtifactError, countCorrect };

const FORMAT = 'taste_cl.web_engine/1';
const MAX_FILE_BYTES = 2 ** 31;  // the most one artifact file may declare (checked before it is fetched)
const GUARD_MODES = ['auto', 'always', 'never'];

function fail(field, value, must) {
  throw new ArtifactError(`web.json \`${field} == ${JSON.stringify(value)?.slice(0, 80)}\`, must be ${must}`);
}

function checkInt(field, value, low, high) {
  if (!Number.isInteger(value) || value < low || value > high) fail(field, value, `an int in [${low}, ${high}]`);
  return value;
}

function checkNumber(field, value, { low = 0, high = Infinity, open = false } = {}) {
  if (typeof value !== 'number' || !Number.isFinite(value) || value < low || (open && value === low) || value > high) {
    fail(field, value, `a finite number in ${open ? '(' : '['}${low}, ${high}]`);
  }
  return value;
}

/** A tensor table of web.json ({name, shape, offset}[]): contiguous float32 tensors filling `bytes`; returns [name, shape, offset, size][]. */
function checkTensors(field, tensors, bytes) {
  if (!Array.isArray(tensors) || tensors.length === 0) fail(field, tensors, 'a non-empty list of tensors');
  let offset = 0;
  const checked = tensors.map((t, i) => {
    if (typeof t?.name !== 'string' || !Array.isArray(t.shape)) fail(`${field}[${i}]`, t, 'an object with a name and a shape');
    t.shape.forEach((d, k) => checkInt(`${field}[${i}].shape[${k}]`, d, 0, 2 ** 31));
    if (t.offset !== offset) fail(`${field}[${i}].offset`, t.offset, `${offset} (the tensors follow each other)`);
    const size = product(t.shape);
    offset += size;
    return [t.name, t.shape, t.offset, size];
  });
  if (offset * 4 !== bytes) fail(`${field}`, `${offset} floats`, `the file's declared ${bytes} bytes / 4`);
  return checked;
}

/** Every value of web.json the learner uses, checked before anything is fetched. */
function checkWeb(web) {
  if (web?.format !== FORMAT) throw new ArtifactError(`web.json has format ${JSON.stringify(web?.format)}; this learner reads ${FORMAT}`);
  for (const [name, entry] of Object.entries(web.files || {})) {
    if (!/^[A-Za-z0-9_.-]+$/.test(name) || name.startsWith('.')) fail('files', name, 'plain file names');
    if (!/^[0-9a-f]{64}$/.test(entry?.sha256 || '')) fail(`files.${name}.sha256`, entry?.sha256, 'a SHA-256 in hex');
    checkInt(`files.${name}.bytes`, entry.bytes, 0, MAX_FILE_BYTES);
  }
  const declared = (name, field) => {
    if (!(name in (web.files || {}))) fail(field, name, 'a file listed in `files`');
    return web.files[name].bytes;
  };
  Object.entries(web.graphs || {}).forEach(([key, name]) => declared(name, `graphs.${key}`));
  if (!web.graphs || !['forward', 'backward', 'optimizer'].every((k) => k in web.graphs)) fail('graphs', web.graphs, 'forward, backward and optimizer');
  if (web.input?.dtype !== 'float32' || typeof web.input.name !== 'string' || !Array.isArray(web.input.shape)) {
    fail('input', web.input, 'one float32 input with a name and a shape');
  }
  web.input.shape.forEach((d, k) => checkInt(`input.shape[${k}]`, d, 1, 2 ** 31));
  checkInt('batch_size', web.batch_size, 1, 2 ** 20);
  if (web.input.shape[0] !== web.batch_size) fail('input.shape[0]', web.input.shape[0], `the batch size ${web.batch_size}`);
  checkInt('num_classes', web.num_classes, 2, 100000);
  const parameters = checkTensors('parameters.tensors', web.parameters?.tensors, declared(web.parameters?.file, 'parameters.file'));
  const state = checkTensors('optimizer.tensors', web.optimizer?.tensors, declared(web.optimizer?.file, 'optimizer.file'));
  const s = web.settings || {};
  if (s.strategy !== 'er') fail('settings.strategy', s.strategy, "'er' (plain experience replay)");
  if (s.replay !== null && s.replay !== 'reservoir') fail('settings.replay', s.replay, "null or 'reservoir'");
  const g = web.guard?.settings || {};
  if (!GUARD_MODES.includes(g.mode)) fail('guard.settings.mode', g.mode, `one of ${GUARD_MODES}`);
  ['max_lr', 'update_bound', 'update_jump'].forEach((k) => checkNumber(`guard.settings.${k}`, g[k], { open: true }));
  checkInt('guard.settings.protect_first', g.protect_first, 0, 2 ** 53);
  checkNumber('settings.lr', s.lr, { open: true, high: g.max_lr });
  checkInt('settings.capacity', s.capacity, 1, 1000000);
  checkInt('settings.replay_batch_size', s.replay_batch_size, 0, 10000);
  checkInt('settings.train_iterations', s.train_iterations, 1, 1000);
  if (s.max_grad_norm !== null) checkNumber('settings.max_grad_norm', s.max_grad_norm, { open: true });
  checkInt('settings.seed', s.seed, 0, Number.MAX_SAFE_INTEGER);
  checkInt('counters.samples_seen', web.counters?.samples_seen, 0, 2 ** 53);
  const featureSize = product(web.input.shape.slice(1));
  const r = web.replay;
  if ((r === null) !== (s.replay === null)) fail('replay', r, 'an object exactly when settings.replay names a buffer');
  if (r !== null) {
    checkInt('replay.size', r.size, 0, s.capacity);
    checkInt('replay.seen', r.seen, r.size, 2 ** 53);
    if (r.capacity !== s.capacity) fail('replay.capacity', r.capacity, `settings.capacity (${s.capacity})`);
    if (r.labels_offset !== r.size * featureSize * 4) fail('replay.labels_offset', r.labels_offset, `${r.size * featureSize * 4}`);
    if (declared(r.file, 'replay.file') !== r.labels_offset + r.size * 4) fail('replay.file', r.file, `${r.labels_offset + r.size * 4} bytes`);
  }
  return { parameters, state, featureSize };
}

async function fetchChecked(base, name, files) {
  const bytes = await fetchBytes(new URL(name, base));
  if (bytes.length !== files[name].bytes) {
    throw new ArtifactError(`artifact file ${name} has ${bytes.length} bytes; web.json says ${files[name].bytes}`);
  }
  if ((await sha256Hex(bytes)) !== files[name].sha256) {
    throw new ArtifactError(`artifact file ${name} is corrupt or was modified: SHA-256 mismatch`);
  }
  return bytes;
}

/** The float32 tensors of a checked table, copied out of `bytes` (little-endian); each must be finite. */
function readTensors(bytes, table, file) {
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const tensors = new Map();
  for (const [name, , offset, size] of table) {
    const values = new Float32Array(size);
    for (let i = 0; i < size; i += 1) values[i] = view.getFloat32((offset + i) * 4, true);
    if (!values.every(Number.isFinite)) throw new ArtifactError(`${file}: ${name} holds NaN or infinite values`);
    tensors.set(name, values);
  }
  return tensors;
}

// ------------------------------------------------------------------ the update guard (taste_cl/guards/size_rule.py)
const NORM_FLOOR = 0.1;
const LOG_SANE_STEP = 0.0;
const LOG_PROXY_JUMP = Math.log(10.0);
const MEASURE_EVERY = 50;
const LOG_ALPHA = 0.2;

const logClamped = (value) => (Number.isNaN(value) ? NaN : Math.log(Math.min(Math.max(value, 1e-30), 1e300)));
const moved = (mean, value) => (mean === null ? value : (1 - LOG_ALPHA) * mean + LOG_ALPHA * value);

/** The device update guard: the Python DeviceUpdateGuard's rule and history, on the JS loop's steps. */
export class UpdateGuard {
  constructor(settings, state) {
    this.settings = settings;
    const sizes = state.sizes;
    const logs = [sizes?.log_proxy, sizes?.log_size];
    if (!logs.every((v) => v === null || (typeof v === 'number' && Math.abs(v) <= 1e3))) fail('guard.state.sizes', sizes, 'logs null or in [-1e3, 1e3]');
    checkInt('guard.state.sizes.since_measure', sizes.since_measure, 0, 2 ** 53);
    checkInt('guard.state.steps_seen', state.steps_seen, 0, 2 ** 53);
    if (state.stepped_lr != null) checkNumber('guard.state.stepped_lr', state.stepped_lr, { high: settings.max_lr });
    [this.logProxy, this.logSize, this.sinceMeasure] = logs.concat(sizes.since_measure);
    this.stepsSeen = state.steps_seen;
    this.steppedLr = state.stepped_lr ?? null;
    this.refusedSteps = 0;
    this.lastCause = null;
  }

  usual(logProxy) {
    return this.logProxy !== null && this.logSize !== null && logProxy <= this.logProxy + LOG_PROXY_JUMP && this.sinceMeasure < MEASURE_EVERY;
  }

  limit() {
    const logJump = Math.log(this.settings.update_jump);
    return this.logSize === null ? logJump : Math.min(logJump, Math.max(LOG_SANE_STEP, logJump + this.logSize));
  }

  /** Why a measured step must be undone, or null (its size then joins the typical size). */
  judge({ largest, change, size, count }) {
    const ratio = change / Math.max(size, NORM_FLOOR * Math.sqrt(count));
    const limit = this.limit();
    if (!Number.isFinite(largest)) return 'non-finite parameters after the step (rolled back)';
    if (!(logClamped(ratio) <= limit)) {
      return `step changed the parameters by ${ratio.toPrecision(3)} times their norm, over the limit of ${Math.exp(limit).toPrecision(3)} (rolled back)`;
    }
    this.logSize = moved(this.logSize, logClamped(ratio));
    this.sinceMeasure = 0;
    return null;
  }

  precheck(lr, gradNorm, loss) {
    if (!(Number.isFinite(loss) && Number.isFinite(gradNorm))) return 'non-finite loss or gradient';
    if (!Number.isFinite(lr)) return `learning rate is ${lr}, must be finite`;
    if (!(lr >= 0 && lr <= this.settings.max_lr)) return `learning rate is ${lr}, must be in [0, max_lr=${this.settings.max_lr}]`;
    return null;
  }

  /** Take the step `apply()` makes on `session` unless unsafe; returns why it was not taken, or null. */
  async step(session, apply, { lr, gradNorm, loss }) {
    this.stepsSeen += 1;
    let cause = this.precheck(lr, gradNorm, loss);
    if (cause === null) {
      const logProxy = logClamped(lr * gradNorm);
      const ordinary = lr * Math.max(1.0, gradNorm) <= this.settings.update_bound;
      const usual = ordinary && this.usual(logProxy) && lr === this.steppedLr;
      const { mode, protect_first: protectFirst } = this.settings;
      const protect = mode === 'always' || this.stepsSeen <= protectFirst || (mode === 'auto' && !usual);
      if (protect) {
        const saved = session.saveStepState();
        await apply();
        cause = this.judge(session.measureStep(saved));
        if (cause !== null) session.restoreStepState(saved);
      } else {
        await apply();
      }
      if (cause === null) {
        this.logProxy = moved(this.logProxy, logProxy);
        if (!protect) this.sinceMeasure += 1;
        this.steppedLr = lr;
      }
    }
    if (cause !== null) {
      this.refusedSteps += 1;
      this.lastCause = cause;
    }
    return cause;
  }

  toJSON() {
    return {
      sizes: { log_proxy: this.logProxy, log_size: this.logSize, since_measure: this.sinceMeasure },
      steps_seen: this.stepsSeen,
      stepped_lr: this.steppedLr,
    };
  }
}

// ------------------------------------------------------------------ the loss (taste_cl/engine/losses.py)
/** Mean cross-entropy of `logits` (n * classes) for `labels`, and its gradient with respect to the logits. */
export function crossEntropy(logits, labels, classes) {
  const n = labels.length;
  const grad = new Float32Array(n * classes);
  let loss = 0;
  for (let i = 0; i < n; i += 1) {
    const row = logits.subarray(i * classes, (i + 1) * classes);
    const top = row.reduce((a, b) => Math.max(a, b), -Infinity);
    let sum = 0;
    for (let c = 0; c < classes; c += 1) sum += Math.exp(row[c] - top);
    const logSum = Math.log(sum);
    loss -= (row[labels[i]] - top - logSum) / n;
    for (let c = 0; c < classes; c += 1) grad[i * classes + c] = (Math.exp(row[c] - top - logSum) - (c === labels[i] ? 1 : 0)) / n;
  }
  return { loss, grad };
}

function totalNorm(gradients) {
  let sum = 0;
  for (const g of gradients.values()) for (const v of g) sum += v * v;
  return Math.sqrt(sum);
}

export class EngineLearner {
  constructor({ ort, sessions, web, tensors, replay, key, saved }) {
    this.ort = ort;
    this.sessions = sessions;
    this.web = web;
    this.key = key;
    this.inputName = web.input.name;
    this.inputShape = web.input.shape.slice(1);
    this.featureSize = product(this.inputShape);
    this.batchSize = web.batch_size;
    this.numClasses = web.num_classes;
    const s = web.settings;
    this.lr = s.lr;
    this.replayBatchSize = s.replay_batch_size;
    this.trainIterations = s.train_iterations;
    this.maxGradNorm = s.max_grad_norm;
    this.parameters = tensors.parameters;
    this.optimizerState = tensors.state;
    this.shapes = new Map(web.parameters.tensors.map((t) => [t.name, t.shape]));
    this.stateShapes = new Map(web.optimizer.tensors.map((t) => [t.name, t.shape]));
    this.replay = replay;
    this.guard = new UpdateGuard(web.guard.settings, saved ? saved.guard : web.guard.state);
    this.samplesSeen = saved ? saved.samplesSeen : web.counters.samples_seen;
    this.app = saved ? saved.app : {};  // free-form data a page stores with the learner
    this.resumed = Boolean(saved);
  }

  /** The optimizer's name, as the page shows it. */
  get optimizerName() { return this.web.optimizer.spec.kind; }

  /**
   * Load the folder at `baseUrl`: web.json checked, then every file's size and SHA-256 before it is used;
   * resume the state saved in IndexedDB for it unless `fresh`. `executionProviders`: ONNX Runtime Web's
   * (default ['wasm']).
   */
  static async load(baseUrl, { ort, fresh = false, key = null, executionProviders = ['wasm'] } = {}) {
    if (!ort || !ort.InferenceSession) throw new ArtifactError('pass { ort } from onnxruntime-web');
    const base = new URL(baseUrl, globalThis.location ? globalThis.location.href : undefined);
    const webBytes = await fetchBytes(new URL('web.json', base));
    let web;
    try {
      web = JSON.parse(new TextDecoder().decode(webBytes));
    } catch (error) {
      throw new ArtifactError(`web.json is not JSON: ${error.message}`);
    }
    const { parameters, state, featureSize } = checkWeb(web);
    const g = web.graphs;
    const names = [g.forward, g.backward, g.optimizer, web.parameters.file, web.optimizer.file, ...(web.replay ? [web.replay.file] : [])];
    const [forwardBytes, backwardBytes, optimizerBytes, parameterBytes, stateBytes, replayBytes] = await Promise.all(
      names.map((name) => fetchChecked(base, name, web.files)),
    );
    const tensors = {
      parameters: readTensors(parameterBytes, parameters, web.parameters.file),
      state: readTensors(stateBytes, state, web.optimizer.file),
    };
    const options = { executionProviders, graphOptimizationLevel: 'all' };
    const sessions = {};
    for (const [role, bytes] of [['forward', forwardBytes], ['backward', backwardBytes], ['optimizer', optimizerBytes]]) {
      sessions[role] = await ortCall(`load ${g[role]}`, ort.InferenceSession.create(bytes, options));
    }
    try {
      checkSignatures(sessions, web, tensors);
      const storageKey = key || await sha256Hex(webBytes);
      if (fresh) await dbRequest('readwrite', (store) => store.delete(storageKey));
      const saved = fresh ? undefined : await dbRequest('readonly', (store) => store.get(storageKey));
      let replay = null;
      const seed = web.settings.seed;
      if (saved) {
        restoreTensors(tensors.parameters, saved.parameters, 'saved parameters');
        restoreTensors(tensors.state, saved.optimizerState, 'saved optimizer state');
        const r = saved.replay;
        if (r) replay = reservoir(web, featureSize, r.seen, r.x, r.y, new Random(r.random), 'saved replay');
      } else if (web.replay) {
        const r = web.replay;
        const view = new DataView(replayBytes.buffer, replayBytes.byteOffset, replayBytes.byteLength);
        const x = Float32Array.from({ length: r.size * featureSize }, (_, i) => view.getFloat32(i * 4, true));
        const y = Array.from({ length: r.size }, (_, i) => view.getInt32(r.labels_offset + i * 4, true));
        // the reservoir continues from the exported one; its random stream is seeded from it (not numpy's: draws differ from Python's)
        replay = reservoir(web, featureSize, r.seen, x, y, new Random(seed * 1000003 + r.seen), web.replay.file);
      }
      return new EngineLearner({ ort, sessions, web, tensors, replay, key: storageKey, saved });
    } catch (error) {  // nothing half-loaded stays behind
      await Promise.all(Object.values(sessions).map((session) => session.release()));
      throw error;
    }
  }

  tensor(values, shape) { return new this.ort.Tensor('float32', values, shape); }

  /** The graphs' batches for `x` (n rows): chunks of batchSize rows, the last padded with its first row. */
  chunks(x, n) {
    const size = this.batchSize;
    const f = this.featureSize;
    const out = [];
    for (let start = 0; start < n; start += size) {
      const taken = Math.min(size, n - start);
      const rows = new Float32Array(size * f);
      rows.set(x.subarray(start * f, (start + taken) * f));
      for (let i = taken; i < size; i += 1) rows.set(x.subarray(start * f, (start + 1) * f), i * f);
      out.push({ rows, taken });
    }
    return out;
  }

  /** The value the graphs' input `name` takes: the chunk's rows, a forward result or a trainable tensor. */
  feed(name, rows, results) {
    if (name === this.inputName) return this.tensor(rows, [this.batchSize, ...this.inputShape]);
    if (results && name in results) return results[name];
    if (this.parameters.has(name)) return this.tensor(this.parameters.get(name), this.shapes.get(name));
    throw new ArtifactError(`the graphs take an input the learner cannot feed: ${name}`);
  }

  /** The outputs (n * numClasses) for `x`; with `train`, what backward() needs is kept (per chunk). */
  async forward(x, n, train) {
    const session = this.sessions.forward;
    const outputs = new Float32Array(n * this.numClasses);
    const kept = [];
    let row = 0;
    for (const { rows, taken } of this.chunks(x, n)) {
      const feeds = Object.fromEntries(session.inputNames.map((name) => [name, this.feed(name, rows, null)]));
      const results = await ortCall('run forward.onnx', train ? session.run(feeds) : session.run(feeds, ['output']));
      outputs.set(results.output.data.subarray(0, taken * this.numClasses), row * this.numClasses);
      if (train) kept.push({ rows, taken, results });
      row += taken;
    }
    return { outputs, kept };
  }

  /** The gradients of the trainable tensors for a forward's `kept` chunks, given dLoss/dOutputs (n * numClasses). */
  async backward(kept, gradOutputs) {
    const session = this.sessions.backward;
    const classes = this.numClasses;
    const total = new Map();
    let row = 0;
    for (const { rows, taken, results } of kept) {
      const part = new Float32Array(this.batchSize * classes);  // padded rows: zero gradient
      part.set(gradOutputs.subarray(row * classes, (row + taken) * classes));
      row += taken;
      const feeds = Object.fromEntries(session.inputNames.map((name) => [
        name, name === 'grad_output' ? this.tensor(part, [this.batchSize, classes]) : this.feed(name, rows, results),
      ]));
      const grads = await ortCall('run backward.onnx', session.run(feeds));
      for (const name of this.parameters.keys()) {
        const g = grads[`grad.${name}`].data;
        const sum = total.get(name);
        if (sum) for (let i = 0; i < g.length; i += 1) sum[i] += g[i];
        else total.set(name, Float32Array.from(g));
      }
    }
    return total;
  }

  /** One step of optimizer.onnx with `gradients` at learning rate `lr`: new parameters and optimizer state. */
  async optimizerStep(gradients, lr) {
    const session = this.sessions.optimizer;
    const feeds = {};
    for (const name of session.inputNames) {
      if (name === 'lr') feeds.lr = this.tensor(Float32Array.of(lr), []);
      else if (name.startsWith('param.')) feeds[name] = this.tensor(this.parameters.get(name.slice(6)), this.shapes.get(name.slice(6)));
      else if (name.startsWith('grad.')) feeds[name] = this.tensor(gradients.get(name.slice(5)), this.shapes.get(name.slice(5)));
      else feeds[name] = this.tensor(this.optimizerState.get(name), this.stateShapes.get(name));
    }
    const results = await ortCall('run optimizer.onnx', session.run(feeds));
    for (const [output, value] of Object.entries(results)) {
      const key = output.slice('new.'.length);
      if (key.startsWith('param.')) this.parameters.set(key.slice(6), Float32Array.from(value.data));
      else this.optimizerState.set(key, Float32Array.from(value.data));
    }
  }

  /** The guard's view of the learner: a step changes the parameters and the optimizer state. */
  saveStepState() {
    const copy = (tensors) => new Map([...tensors].map(([name, v]) => [name, v.slice()]));
    return { parameters: copy(this.parameters), state: copy(this.optimizerState) };
  }

  measureStep(saved) {
    let largest = 0;
    let change = 0;
    let size = 0;
    let count = 0;
    for (const [name, old] of saved.parameters) {
      const now = this.parameters.get(name);
      for (let i = 0; i < old.length; i += 1) {
        largest = Math.max(largest, Math.abs(now[i]));
        if (Number.isNaN(now[i])) largest = NaN;
        change += (now[i] - old[i]) ** 2;
        size += old[i] * old[i];
      }
      count += old.length;
    }
    return { largest, change: Math.sqrt(change), size: Math.sqrt(size), count };
  }

  restoreStepState(saved) {
    this.parameters = saved.parameters;
    this.optimizerState = saved.state;
  }

  /** One guarded step on checked rows `x` (n rows) and `labels`: {loss, outputs (n * numClasses), cause}. */
  async step(x, labels) {
    const n = labels.length;
    const { outputs, kept } = await this.forward(x, n, true);
    const { loss, grad } = crossEntropy(outputs, labels, this.numClasses);
    let gradients = await this.backward(kept, grad);
    let norm = totalNorm(gradients);
    if (this.maxGradNorm !== null && norm > this.maxGradNorm) {  // torch's clip_grad_norm_ (NaN is not clipped: the guard refuses it)
      const scale = this.maxGradNorm / (norm + 1e-6);
      gradients = new Map([...gradients].map(([name, g]) => [name, g.map((v) => v * scale)]));
      norm = this.maxGradNorm;
    }
    const cause = await this.guard.step(this, () => this.optimizerStep(gradients, this.lr), { lr: this.lr, gradNorm: norm, loss });
    return { loss, outputs, cause };
  }

  /** One guarded step on `x` (n * featureSize floats) and `y` (n labels), no replay: {loss, logits, skipped, cause}. */
  async trainStep(x, y) {
    const features = checkFeatures(x, this.featureSize, this.inputShape);
    const labels = checkLabels(y, features.length / this.featureSize, this.numClasses);
    const { loss, outputs, cause } = await this.step(features, labels);
    return { loss, logits: outputs, skipped: cause !== null, cause };
  }

  /** Logits (n * numClasses floats) of the forward graph; changes no state. */
  async predict(x) {
    const features = checkFeatures(x, this.featureSize, this.inputShape);
    return (await this.forward(features, features.length / this.featureSize, false)).outputs;
  }

  /** Test-then-train on one batch with replay, under the guard, then save to IndexedDB; returns the stats. */
  async observe(x, y) {
    const features = checkFeatures(x, this.featureSize, this.inputShape);
    const n = features.length / this.featureSize;
    const labels = checkLabels(y, n, this.numClasses);
    const start = performance.now();
    const scored = (await this.forward(features, n, false)).outputs;
    const correct = scored.every(Number.isFinite) ? countCorrect(scored, labels, this.numClasses) : 0;
    let lossSum = 0;
    let steps = 0;
    let replayed = 0;
    let outputs = scored;
    const causes = [];
    for (let iteration = 0; iteration < this.trainIterations; iteration += 1) {
      let trainX = features;
      let trainY = labels;
      if (this.replay && this.replay.size && this.replayBatchSize) {
        const rehearsal = this.replay.sample(this.replayBatchSize);
        trainX = new Float32Array(features.length + rehearsal.x.length);
        trainX.set(features);
        trainX.set(rehearsal.x, features.length);
        trainY = labels.concat(rehearsal.y);
        replayed += rehearsal.y.length;
      }
      const result = await this.step(trainX, trainY);
      lossSum += result.loss;
      outputs = result.outputs.subarray(0, n * this.numClasses);
      if (result.cause === null) steps += 1;
      else causes.push(result.cause);
    }
    if (this.replay && outputs.every(Number.isFinite)) this.replay.add(features, labels);
    this.samplesSeen += n;
    await this.save();
    return {
      loss: lossSum / this.trainIterations,
      accuracy: correct / n,
      samples: n,
      replaySamples: replayed,
      steps,
      refused: causes.length,
      causes,
      stepTimeMs: performance.now() - start,
      skipped: causes.length > 0,
    };
  }

  /** Save parameters, optimizer state, buffer, guard history, counters and `app` data to IndexedDB (observe() calls it). */
  async save() {
    const r = this.replay;
    const record = {
      parameters: Object.fromEntries(this.parameters),
      optimizerState: Object.fromEntries(this.optimizerState),
      replay: r && { capacity: r.capacity, seen: r.seen, x: r.x.slice(0, r.size * r.featureSize), y: r.y.slice(), random: r.random.state },
      guard: this.guard.toJSON(),
      samplesSeen: this.samplesSeen,
      app: this.app,
    };
    await dbRequest('readwrite', (store) => store.put(record, this.key));
  }

  /** Forget the saved state (the next load starts from the artifacts again). */
  async forget() {
    await dbRequest('readwrite', (store) => store.delete(this.key));
  }

  async release() {
    await Promise.all(Object.values(this.sessions).map((session) => session.release()));
  }
}

/** The buffer of `y.length` rows `x` (checked: finite features, labels of the output, within the capacity). */
function reservoir(web, featureSize, seen, x, y, random, what) {
  const capacity = web.settings.capacity;
  if (!(x instanceof Float32Array) || x.length !== y.length * featureSize || y.length > capacity || !(seen >= y.length)) {
    throw new ArtifactError(`${what} holds ${y.length} rows of ${x?.length} values, which do not fit ${capacity} rows of ${featureSize} (seen ${seen})`);
  }
  try {
    if (y.length) checkFeatures(x, featureSize, web.input.shape.slice(1), 'its features');
    checkLabels(y, y.length, web.num_classes);
  } catch (error) {
    throw new ArtifactError(`${what}: ${error.message}`);
  }
  return new Reservoir(capacity, featureSize, { seen, x, y, random });
}

/** The sessions' inputs and outputs are what web.json's tensors need (ArtifactError naming the mismatch). */
function checkSignatures(sessions, web, tensors) {
  const trainable = [...tensors.parameters.keys()];
  const grads = trainable.map((name) => `grad.${name}`);
  if (sessions.forward.outputNames[0] !== 'output') throw new ArtifactError(`${web.graphs.forward}'s first output must be 'output'`);
  if (JSON.stringify(sessions.backward.outputNames) !== JSON.stringify(grads)) {
    throw new ArtifactError(`${web.graphs.backward} does not return the gradients of the trainable tensors in order`);
  }
  const known = new Set([web.input.name, 'grad_output', ...trainable, ...sessions.forward.outputNames]);
  const unknown = [...sessions.forward.inputNames, ...sessions.backward.inputNames].filter((name) => !known.has(name));
  if (unknown.length) throw new ArtifactError(`the graphs take inputs the learner cannot feed: ${unknown}`);
  for (const name of sessions.optimizer.inputNames) {
    const ok = name === 'lr' || (name.startsWith('param.') && tensors.parameters.has(name.slice(6)))
      || (name.startsWith('grad.') && tensors.parameters.has(name.slice(5))) || tensors.state.has(name);
    if (!ok) throw new ArtifactError(`${web.graphs.optimizer} takes ${name}, which web.json's tensors do not hold`);
  }
}

/** Replace `tensors`' values with a saved record's (same names and lengths, finite), or refuse the record. */
function restoreTensors(tensors, saved, what) {
  const names = Object.keys(saved || {});
  const fits = names.length === tensors.size && names.every((name) => tensors.has(name) && saved[name] instanceof Float32Array
    && saved[name].length === tensors.get(name).length && saved[name].every(Number.isFinite));
  if (!fits) throw new ArtifactError(`${what} in IndexedDB do not fit these artifacts: call forget() or load with { fresh: true }`);
  names.forEach((name) => tensors.set(name, saved[name]));
}
