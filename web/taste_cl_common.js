// What the browser learners share (taste_cl_web.js on the deprecated training build, taste_cl_engine.js on
// current ONNX Runtime Web): errors, the seeded generator, the reservoir, fetching with SHA-256 checks,
// IndexedDB, batch checks and accuracy.

const DB_NAME = 'taste_cl';
const STORE = 'learners';

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

export async function fetchBytes(url) {
  const response = await fetch(url);
  if (!response.ok) throw new ArtifactError(`cannot fetch ${url}: HTTP ${response.status}`);
  return new Uint8Array(await response.arrayBuffer());
}

export async function sha256Hex(bytes) {
  const digest = new Uint8Array(await crypto.subtle.digest('SHA-256', bytes));
  return Array.from(digest, (b) => b.toString(16).padStart(2, '0')).join('');
}

function openDb() {
  return new Promise((resolve, reject) => {
    const request = indexedDB.open(DB_NAME, 1);
    request.onupgradeneeded = () => request.result.createObjectStore(STORE);
    request.onsuccess = () => resolve(request.result);
    request.onerror = () => reject(request.error);
  });
}

export async function dbRequest(mode, act) {
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

export function product(values) { return values.reduce((a, b) => a * b, 1); }

// The wasm build turns C++ exceptions into bare numbers; say what failed instead.
export async function ortCall(what, promise) {
  try {
    return await promise;
  } catch (error) {
    const detail = error instanceof Error ? error.message : `wasm exception ${String(error)}`;
    throw new ArtifactError(`ONNX Runtime Web failed to ${what}: ${detail}`);
  }
}

/** `x` as a Float32Array of whole rows of `featureSize` finite values (RangeError naming the problem). */
export function checkFeatures(x, featureSize, inputShape, what = 'x') {
  const data = x instanceof Float32Array ? x : Float32Array.from(x);
  if (data.length === 0 || data.length % featureSize !== 0) {
    throw new RangeError(`${what} has ${data.length} values, must be a positive multiple of ${featureSize} (shape ${inputShape})`);
  }
  const bad = data.reduce((count, v) => count + (Number.isFinite(v) ? 0 : 1), 0);
  if (bad) throw new RangeError(`${what} contains ${bad} non-finite value(s) (NaN or inf)`);
  return data;
}

/** `y` as `n` class indices in [0, numClasses) (RangeError naming the bad one). */
export function checkLabels(y, n, numClasses) {
  const labels = Array.from(y, Number);
  if (labels.length !== n) throw new RangeError(`y has ${labels.length} labels for ${n} samples`);
  for (const label of labels) {
    if (!Number.isInteger(label) || label < 0 || label >= numClasses) {
      throw new RangeError(`label ${label} is not a class index in [0, ${numClasses})`);
    }
  }
  return labels;
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
