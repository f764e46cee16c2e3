// Drive a page in headless Chromium over the DevTools protocol: one browser, a list of steps,
// results as JSON. Used by tests/test_web.py and `taste-cl bench web-step`.
//
//   node web/tools/drive.mjs spec.json    (Node 20.10-21: node --experimental-websocket ...)
//
// spec.json: {"chromium": "/usr/bin/chromium", "out": "results.json", "timeout_ms": 60000, "js_flags": "",
//             "steps": [{"goto": "http://127.0.0.1:8000/?fresh=1"},     // waits for the page's
//                       {"eval": "demo.learner.lr", "as": "lr"},         //   body[data-state]
//                       {"reload": true},
//                       {"pause": "label"},  // waits until the caller deletes <out>.pause
//                       {"screenshot": "/tmp/demo.png"}]}
// "eval" takes a JavaScript expression (awaited if it is a promise); its JSON value is stored
// under "as". The browser is started with a fresh profile in its own process group, whose id
// (the browser's PID) is written to `<out>.pid`; the group is stopped and the profile deleted
// whatever happens; a failing step writes {"error": ...} and exits 1.
import { spawn } from 'node:child_process';
import { mkdtempSync, readFileSync, rmSync, writeFileSync, existsSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

async function waitFor(what, predicate, timeoutMs) {
  const end = Date.now() + timeoutMs;
  for (;;) {
    const value = await predicate();
    if (value) return value;
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
    await sleep(50);
  }
}

class Cdp {
  constructor(url) {
    this.ws = new WebSocket(url);
    this.nextId = 1;
    this.pending = new Map();
    this.ws.onmessage = (event) => {
      const message = JSON.parse(event.data);
      const entry = this.pending.get(message.id);
      if (!entry) return;
      this.pending.delete(message.id);
      if (message.error) entry.reject(new Error(`${entry.method}: ${message.error.message}`));
      else entry.resolve(message.result);
    };
    this.opened = new Promise((resolve, reject) => { this.ws.onopen = resolve; this.ws.onerror = reject; });
  }
  send(method, params = {}) {
    const id = this.nextId;
    this.nextId += 1;
    this.ws.send(JSON.stringify({ id, method, params }));
    return new Promise((resolve, reject) => this.pending.set(id, { resolve, reject, method }));
  }
  async evaluate(expression) {
    const result = await this.send('Runtime.evaluate', { expression, awaitPromise: true, returnByValue: true });
    if (result.exceptionDetails) {
      const d = result.exceptionDetails;
      throw new Error(`page threw: ${d.exception?.description || d.text}`);
    }
    return result.result.value;
  }
  close() { this.ws.close(); }
}

async function waitForPage(cdp, timeoutMs) {
  const state = await waitFor('the page to finish loading', async () => {
    try {
      const s = await cdp.evaluate("document.readyState === 'complete' && document.body ? document.body.dataset.state : ''");
      return s && s !== 'loading' ? s : '';
    } catch { return ''; }  // the old document may be gone mid-navigation
  }, timeoutMs);
  if (state === 'error') {
    throw new Error(`page failed: ${await cdp.evaluate("document.getElementById('status')?.textContent || ''")}`);
  }
}

async function main() {
  const spec = JSON.parse(readFileSync(process.argv[2], 'utf8'));
  if (typeof WebSocket === 'undefined') throw new Error('this Node has no WebSocket: run it with --experimental-websocket (Node >= 20.10)');
  const timeoutMs = spec.timeout_ms || 60000;
  const profile = mkdtempSync(join(tmpdir(), 'taste-cl-chromium-'));
  const browser = spawn(spec.chromium, [
    '--headless', '--no-sandbox', '--disable-gpu', '--no-first-run', '--no-default-browser-check',
    '--disable-extensions', '--disable-background-networking', '--mute-audio',
    // a headless page counts as hidden: keep its renderer at normal priority and its timers unthrottled
    '--disable-renderer-backgrounding', '--disable-background-timer-throttling', '--disable-backgrounding-occluded-windows',
    `--window-size=${spec.window || '800,340'}`, '--remote-debugging-port=0', `--user-data-dir=${profile}`,
    ...(spec.js_flags ? [`--js-flags=${spec.js_flags}`] : []), 'about:blank',
  ], { stdio: ['ignore', 'ignore', 'pipe'], detached: true });  // its own process group, stopped as one
  writeFileSync(`${spec.out}.pid`, String(browser.pid));  // lets the caller stop it if this script is killed
  let stderr = '';
  browser.stderr.on('data', (chunk) => { stderr = (stderr + chunk).slice(-4000); });
  const exited = new Promise((resolve) => browser.on('exit', resolve));
  const results = { browser_pid: browser.pid };
  let cdp = null;
  try {
    const portFile = join(profile, 'DevToolsActivePort');
    await waitFor('Chromium to start', () => existsSync(portFile) && readFileSync(portFile, 'utf8').includes('\n'), 30000);
    const port = readFileSync(portFile, 'utf8').split('\n')[0];
    const targets = await (await fetch(`http://127.0.0.1:${port}/json/list`)).json();
    const page = targets.find((t) => t.type === 'page');
    cdp = new Cdp(page.webSocketDebuggerUrl);
    await cdp.opened;
    await cdp.send('Page.enable');
    await cdp.send('Runtime.enable');
    const [width, height] = (spec.window || '800,340').split(',').map(Number);
    await cdp.send('Emulation.setDeviceMetricsOverride', { width, height, deviceScaleFactor: 1, mobile: false });
    results.user_agent = (await cdp.send('Browser.getVersion')).product;
    for (const step of spec.steps) {
      if (step.goto) {
        await cdp.send('Page.navigate', { url: step.goto });
        await sleep(100);
        await waitForPage(cdp, timeoutMs);
      } else if (step.reload) {
        await cdp.send('Page.reload', { ignoreCache: true });
        await sleep(100);
        await waitForPage(cdp, timeoutMs);
      } else if (step.eval) {
        const value = await cdp.evaluate(step.eval);
        if (step.as) results[step.as] = value;
      } else if (step.pause) {  // hand over to the caller: it deletes <out>.pause when done
        const pauseFile = `${spec.out}.pause`;
        writeFileSync(pauseFile, String(step.pause));
        await waitFor(`the caller to finish "${step.pause}"`, () => !existsSync(pauseFile), timeoutMs);
      } else if (step.screenshot) {
        const shot = await cdp.send('Page.captureScreenshot', { format: 'png' });
        writeFileSync(step.screenshot, Buffer.from(shot.data, 'base64'));
      } else {
        throw new Error(`unknown step ${JSON.stringify(step)}`);
      }
    }
  } catch (error) {
    results.error = String(error && error.stack ? error.stack : error);
    results.browser_stderr = stderr;
  } finally {
    if (cdp) cdp.close();
    const stop = (signal) => { try { process.kill(-browser.pid, signal); } catch { /* already gone */ } };
    stop('SIGTERM');
    const killer = setTimeout(() => stop('SIGKILL'), 5000);
    await exited;
    clearTimeout(killer);
    stop('SIGKILL');  // helpers (renderer, GPU, utility processes) that outlived the browser
    rmSync(profile, { recursive: true, force: true, maxRetries: 10, retryDelay: 100 });
  }
  writeFileSync(spec.out, JSON.stringify(results));
  process.exitCode = results.error ? 1 : 0;
}

main().catch((error) => { console.error(error); process.exitCode = 2; });
