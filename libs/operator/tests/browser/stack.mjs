// Drives Debian's chromium, headless, through the operator console over a
// whole stack that e2e/tests/console.rs started, holding one order whose
// PaymentCaptured the saga dead-lettered and which the history parked
// (both causes fixed since): usage
//   node stack.mjs URL TOKEN SCREENSHOT_DIR TENANT ORDER_ID
// Each step asserts what the page shows and keeps a screenshot.
import assert from 'node:assert/strict';
import { open } from './common.mjs';

const [url, token, shots, tenant, order] = process.argv.slice(2);
const { browser, page, shot, step } = await open(shots, 900);
const story = `${url}/orders?tenant=${tenant}&id=${order}`;

// Reloads `where` until `text` shows, within `secs`.
async function until(where, text, secs = 30) {
  const deadline = Date.now() + secs * 1000;
  for (;;) {
    await page.goto(where);
    if ((await page.getByText(text).count()) > 0) return;
    if (Date.now() > deadline) throw new Error(`${where} never showed ${text}`);
    await page.waitForTimeout(500);
  }
}

try {
  step('signed in: the overview names the dead letter and the parked order');
  await page.goto(`${url}/login`);
  await page.fill('input[name=token]', token);
  await Promise.all([page.waitForURL(`${url}/`), page.click('button:has-text("Sign in")')]);
  await page.getByText('orders.saga: 1 dead-lettered message(s)').waitFor();
  await page.getByText('projection.history: 1 aggregate(s) parked').waitFor();
  await shot('01-overview-two-problems');

  step("the dead letter's group shows its cause: the database's error");
  await page.click('#problems a[href="/dead-letters"]');
  await page.getByText('held_for_review').first().waitFor();
  assert.match(await page.textContent('main'), /database 23514/);
  await shot('02-dead-letter-cause');

  step('re-driven after the fix: the letter is gone, the order completes');
  await page.click('button:has-text("Re-drive these 1")');
  await page.getByText("1 letter(s) back on orders.saga's queue").waitFor();
  await shot('03-re-driven');
  await until(story, '"status": "confirmed"');
  step("the order's story: its payment attempts and its trace");
  assert.match(await page.textContent('#rows'), /"attempts": 1/);
  assert.match(await page.textContent('#events'), /[0-9a-f]{32}/);
  await shot('04-order-confirmed');

  step('the parked order: OrderConfirmed waits behind the OrderPlaced it refused');
  await until(`${url}/parked`, 'no_placed_orders');
  const waiting = async () => (await page.textContent('#parked tr:nth-child(2) td:nth-child(7)')).trim();
  const deadline = Date.now() + 30000;
  while ((await waiting()) !== '2') {
    assert.ok(Date.now() < deadline, 'OrderConfirmed never joined the parked order');
    await page.waitForTimeout(500);
    await page.goto(`${url}/parked`);
  }
  await shot('05-parked');
  await page.click('button:has-text("Unpark")');
  await page.getByText('2 event(s) to replay in order').waitFor();
  await until(`${url}/parked`, 'No aggregate is parked.');
  await shot('06-unparked');

  step('nothing needs an operator now');
  await until(`${url}/`, 'Nothing: every outbox drains and every consumer applies.');
  await shot('07-overview-clear');
} catch (e) {
  await shot('failed');
  console.error(e);
  process.exitCode = 1;
} finally {
  await browser.close();
}
