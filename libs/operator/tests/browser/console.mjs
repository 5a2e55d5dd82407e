// Drives Debian's chromium, headless, through the operator console that
// console_browser.rs started over a prepared state: usage
//   node console.mjs URL TOKEN SCREENSHOT_DIR
// Each step asserts what the page shows and keeps a screenshot.
import assert from 'node:assert/strict';
import { open } from './common.mjs';

const [url, token, shots] = process.argv.slice(2);
const { browser, page, shot, step } = await open(shots, 800);

try {
  step('without the token: 401 and the sign-in form');
  let answer = await page.goto(`${url}/`);
  assert.equal(answer.status(), 401);
  await shot('01-sign-in');

  step('signed in: the overview');
  await page.fill('input[name=token]', token);
  await Promise.all([page.waitForURL(`${url}/`), page.click('button:has-text("Sign in")')]);
  assert.match(await page.textContent('h1'), /Overview/);
  await page.locator('#problems').waitFor();
  await shot('02-overview');

  step('a forged POST, with the session cookie and no CSRF token: refused');
  answer = await page.request.post(`${url}/dead-letters/redrive`, {
    form: { consumer: 'shop.views' },
    maxRedirects: 0,
  });
  assert.equal(answer.status(), 403);

  step("dead letters grouped by cause, from the overview's problem; the group re-driven");
  await page.goto(`${url}/`);
  await page.click('#problems a[href="/dead-letters"]');
  await page.getByText('permanent: no order #').waitFor();
  await shot('03-dead-letters');
  await page.click('button:has-text("Re-drive these 2")');
  await page.getByText("2 letter(s) back on shop.views's queue").waitFor();
  assert.equal(await page.getByText('permanent: no order #').count(), 0);
  await shot('04-dead-letters-re-driven');

  step('a parked aggregate: skip asks first, then drops the event shown');
  await page.click('a:has-text("Parked")');
  await page.getByText('handler: no such status').waitFor();
  await shot('05-parked');
  await page.click('a:has-text("Skip message 900")');
  await page.getByText('Drop message 900 for good').waitFor();
  await shot('06-skip-asks');
  await page.click('button:has-text("Drop message 900 for good")');
  await page.getByText('message 900 (OrderConfirmed) of order:42 dropped').waitFor();

  step('unpark: asked once, then under way');
  await page.click('button:has-text("Unpark")');
  await page.getByText('1 event(s) to replay in order').waitFor();
  await page.getByText('unpark under way').waitFor();
  await shot('07-unparked');

  step("an order's story: its payment attempts");
  await page.fill('input[name=tenant]', '1');
  await page.fill('input[name=id]', '42');
  await page.click('button:has-text("Explain")');
  await page.getByText('Order 42 of tenant 1').waitFor();
  assert.match(await page.textContent('#rows'), /"attempts": 2/);
  await shot('08-order-story');

  step('stuck orders link to their story');
  await page.click('a:has-text("Stuck orders")');
  await page.locator('a[href="/orders?tenant=1&id=42"]').waitFor();
  await shot('09-stuck');
} catch (e) {
  await shot('failed');
  console.error(e);
  process.exitCode = 1;
} finally {
  await browser.close();
}
