//! A second AMQP client for the relay's question (issue 24): does the broker
//! or the client library bound a confirmed publisher? This one is the
//! protocol and nothing else: AMQP 0-9-1 frames written by hand on one TCP
//! socket, a sliding window of publisher confirms read by a second task, no
//! heartbeats, no channel multiplexing, no futures per message. It publishes
//! the same messages as lapin's sliding window (same exchange, properties,
//! mandatory flag), so the two rates are comparable in the same run.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{Context, bail, ensure};
use lapin::types::AMQPValue;
use reliability::broker::Outgoing;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::TcpStream;
use tokio::net::tcp::OwnedReadHalf;
use tokio::sync::Semaphore;

const FRAME_METHOD: u8 = 1;
const FRAME_HEADER: u8 = 2;
const FRAME_BODY: u8 = 3;
const FRAME_END: u8 = 0xCE;
const CHANNEL: u16 = 1;

/// Frame payloads, built with the protocol's few field types.
#[derive(Default)]
struct Buf(Vec<u8>);

impl Buf {
    fn method(class: u16, method: u16) -> Self {
        let mut b = Self::default();
        b.u16(class).u16(method);
        b
    }
    fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    fn u16(&mut self, v: u16) -> &mut Self {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }
    fn short(&mut self, s: &str) -> &mut Self {
        self.u8(u8::try_from(s.len()).unwrap_or(u8::MAX));
        self.0.extend_from_slice(&s.as_bytes()[..s.len().min(255)]);
        self
    }
    fn long(&mut self, s: &[u8]) -> &mut Self {
        self.u32(u32::try_from(s.len()).unwrap_or(u32::MAX));
        self.0.extend_from_slice(s);
        self
    }
}

fn frame(out: &mut Vec<u8>, kind: u8, channel: u16, payload: &[u8]) {
    out.push(kind);
    out.extend_from_slice(&channel.to_be_bytes());
    out.extend_from_slice(
        &u32::try_from(payload.len())
            .unwrap_or(u32::MAX)
            .to_be_bytes(),
    );
    out.extend_from_slice(payload);
    out.push(FRAME_END);
}

/// The next frame: kind, channel, payload.
async fn read_frame(r: &mut BufReader<OwnedReadHalf>) -> anyhow::Result<(u8, u16, Vec<u8>)> {
    let kind = r.read_u8().await?;
    let channel = r.read_u16().await?;
    let size = r.read_u32().await?;
    let mut payload = vec![0; usize::try_from(size)?];
    r.read_exact(&mut payload).await?;
    ensure!(r.read_u8().await? == FRAME_END, "bad frame end");
    Ok((kind, channel, payload))
}

/// Reads until the method `(class, method)` arrives; a Close instead is an
/// error with the broker's reason.
async fn expect(
    r: &mut BufReader<OwnedReadHalf>,
    class: u16,
    method: u16,
) -> anyhow::Result<Vec<u8>> {
    loop {
        let (kind, _, p) = read_frame(r).await?;
        if kind != FRAME_METHOD || p.len() < 4 {
            continue;
        }
        let got = (
            u16::from_be_bytes([p[0], p[1]]),
            u16::from_be_bytes([p[2], p[3]]),
        );
        if got == (class, method) {
            return Ok(p[4..].to_vec());
        }
        if got == (10, 50) || got == (20, 40) {
            let reason = p.get(7..).map(String::from_utf8_lossy).unwrap_or_default();
            bail!("the broker closed: {reason}");
        }
    }
}

/// `amqp://user:pass@host:port/vhost`, the parts this client uses.
fn parse(url: &str) -> anyhow::Result<(String, String, String, String)> {
    let rest = url.strip_prefix("amqp://").context("amqp:// URL")?;
    let rest = rest.split('?').next().unwrap_or(rest);
    let (auth, rest) = rest.rsplit_once('@').unwrap_or(("guest:guest", rest));
    let (user, pass) = auth.split_once(':').unwrap_or((auth, ""));
    let (addr, vhost) = rest.split_once('/').unwrap_or((rest, ""));
    let vhost = match vhost {
        "" => "/".to_owned(),
        v => v.replace("%2f", "/").replace("%2F", "/"),
    };
    let addr = if addr.contains(':') {
        addr.to_owned()
    } else {
        format!("{addr}:5672")
    };
    Ok((addr, user.to_owned(), pass.to_owned(), vhost))
}

/// Publishes `messages` to `exchange` with at most `window` unconfirmed,
/// returning once the broker confirmed every one. Fails on a nack or a
/// return (unroutable), as lapin's sliding window does.
pub(crate) async fn sliding_window_publish(
    url: &str,
    exchange: &str,
    messages: &[Outgoing],
    window: usize,
) -> anyhow::Result<()> {
    let (addr, user, pass, vhost) = parse(url)?;
    let stream = TcpStream::connect(&addr).await?;
    stream.set_nodelay(true)?;
    let (rd, wr) = stream.into_split();
    let mut r = BufReader::with_capacity(64 * 1024, rd);
    let mut w = BufWriter::with_capacity(256 * 1024, wr);
    let mut out = Vec::new();
    w.write_all(b"AMQP\x00\x00\x09\x01").await?;
    w.flush().await?;
    expect(&mut r, 10, 10).await?;
    let mut plain = vec![0];
    plain.extend_from_slice(user.as_bytes());
    plain.push(0);
    plain.extend_from_slice(pass.as_bytes());
    let mut start_ok = Buf::method(10, 11);
    start_ok.u32(0).short("PLAIN").long(&plain).short("en_US");
    frame(&mut out, FRAME_METHOD, 0, &start_ok.0);
    w.write_all(&out).await?;
    w.flush().await?;
    out.clear();
    let tune = expect(&mut r, 10, 30).await?;
    ensure!(tune.len() >= 8, "short Tune");
    let channel_max = u16::from_be_bytes([tune[0], tune[1]]);
    let frame_max = u32::from_be_bytes([tune[2], tune[3], tune[4], tune[5]]);
    let mut tune_ok = Buf::method(10, 31);
    tune_ok.u16(channel_max).u32(frame_max).u16(0);
    let mut open = Buf::method(10, 40);
    open.short(&vhost).short("").u8(0);
    frame(&mut out, FRAME_METHOD, 0, &tune_ok.0);
    frame(&mut out, FRAME_METHOD, 0, &open.0);
    w.write_all(&out).await?;
    w.flush().await?;
    out.clear();
    expect(&mut r, 10, 41).await?;
    let mut channel_open = Buf::method(20, 10);
    channel_open.short("");
    let mut select = Buf::method(85, 10);
    select.u8(0);
    frame(&mut out, FRAME_METHOD, CHANNEL, &channel_open.0);
    frame(&mut out, FRAME_METHOD, CHANNEL, &select.0);
    w.write_all(&out).await?;
    w.flush().await?;
    out.clear();
    expect(&mut r, 20, 11).await?;
    expect(&mut r, 85, 11).await?;

    // Confirms free window slots; a nack or a return ends the run.
    let slots = Arc::new(Semaphore::new(window));
    let total = u64::try_from(messages.len())?;
    let failed = Arc::new(AtomicBool::new(false));
    let reader = {
        let (slots, failed) = (slots.clone(), failed.clone());
        tokio::spawn(async move {
            // Every tag up to `below` is confirmed, and the single acks
            // above it (confirms may come out of order).
            let (mut below, mut above) = (0_u64, std::collections::BTreeSet::new());
            while below + (above.len() as u64) < total {
                let (kind, _, p) = read_frame(&mut r).await?;
                if kind != FRAME_METHOD || p.len() < 4 {
                    continue;
                }
                let method = (
                    u16::from_be_bytes([p[0], p[1]]),
                    u16::from_be_bytes([p[2], p[3]]),
                );
                match method {
                    (60, 80) => {
                        let tag = u64::from_be_bytes(p[4..12].try_into()?);
                        let multiple = p[12] & 1 == 1;
                        let was = below + above.len() as u64;
                        if multiple && tag > below {
                            above = above.split_off(&(tag + 1));
                            below = tag;
                        } else if tag > below {
                            above.insert(tag);
                        }
                        let now = below + above.len() as u64;
                        slots.add_permits(usize::try_from(now - was)?);
                    }
                    (60, 120) => {
                        failed.store(true, Ordering::Release);
                        bail!("nacked");
                    }
                    (60, 50) => {
                        failed.store(true, Ordering::Release);
                        bail!("returned: not routed");
                    }
                    (10, 50) | (20, 40) => {
                        failed.store(true, Ordering::Release);
                        bail!("the broker closed the connection");
                    }
                    _ => {}
                }
            }
            Ok::<_, anyhow::Error>(r)
        })
    };

    let body_max = usize::try_from(frame_max)? - 8;
    for m in messages {
        // Flush what is buffered before waiting: the broker cannot confirm
        // what it has not received.
        let permit = match slots.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                w.write_all(&out).await?;
                w.flush().await?;
                out.clear();
                slots.clone().acquire_owned().await?
            }
        };
        permit.forget();
        ensure!(!failed.load(Ordering::Acquire), "the publisher failed");
        let mut publish = Buf::method(60, 40);
        publish
            .u16(0)
            .short(exchange)
            .short(&m.routing_key)
            .u8(0b01);
        frame(&mut out, FRAME_METHOD, CHANNEL, &publish.0);
        // Properties as lapin sends them: content-type, headers,
        // delivery-mode, message-id, type.
        let mut header = Buf::default();
        header
            .u16(60)
            .u16(0)
            .u64(u64::try_from(m.body.len())?)
            .u16(1 << 15 | 1 << 13 | 1 << 12 | 1 << 7 | 1 << 5)
            .short("application/json");
        let mut table = Buf::default();
        for (k, v) in m.headers.inner() {
            let AMQPValue::LongString(s) = v else {
                bail!("header {k}: only strings are sent");
            };
            table.short(k.as_str()).u8(b'S').long(s.as_bytes());
        }
        header
            .long(&table.0)
            .u8(2)
            .short(&m.message_id)
            .short(&m.kind);
        frame(&mut out, FRAME_HEADER, CHANNEL, &header.0);
        for chunk in m.body.chunks(body_max) {
            frame(&mut out, FRAME_BODY, CHANNEL, chunk);
        }
        if out.len() >= 128 * 1024 {
            w.write_all(&out).await?;
            out.clear();
        }
    }
    w.write_all(&out).await?;
    w.flush().await?;
    let mut r = reader.await??;
    let mut close = Buf::method(10, 50);
    close.u16(200).short("done").u16(0).u16(0);
    frame(&mut out, FRAME_METHOD, 0, &close.0);
    w.write_all(&out).await?;
    w.flush().await?;
    expect(&mut r, 10, 51).await?;
    Ok(())
}
