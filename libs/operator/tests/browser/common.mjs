// What both browser scripts share: Debian's chromium through
// playwright-core (never a browser download), a page, its screenshots and
// the steps it prints.
import { chromium } from 'playwright-core';

export async function open(shots, height) {
  const browser = await chromium.launch({
    executablePath: process.env.CHROMIUM ?? '/usr/bin/chromium',
    args: ['--no-sandbox'],
  });
  const page = await browser.newPage({ viewport: { width: 1280, height } });
  const shot = (name) => page.screenshot({ path: `${shots}/${name}.png`, fullPage: true });
  const step = (what) => console.log(`- ${what}`);
  return { browser, page, shot, step };
}
