//! A TCP proxy a test can cut, freeze and restore: an outage between a\n//! service and PostgreSQL or RabbitMQ, on demand.

use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::{Arc, Mutex};

use sqlx::postgres::PgConnectOptions;
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

use super::{amqp_url, database_url};

/// A TCP proxy in front of a server (the broker) that a test can cut:
/// while down it drops live connections and refuses new ones, as a broker
/// that died would.
pub struct TcpProxy {
    pub addr: SocketAddr,
    state: Arc<Mutex<ProxyState>>,
    stop: CancellationToken,
}

struct ProxyState {
    up: bool,
    generation: CancellationToken,
    frozen: tokio::sync::watch::Sender<bool>,
}

impl TcpProxy {
    pub async fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("proxy address");
        let state = Arc::new(Mutex::new(ProxyState {
            up: true,
            generation: CancellationToken::new(),
            frozen: tokio::sync::watch::Sender::new(false),
        }));
        let stop = CancellationToken::new();
        let (st, stop2) = (state.clone(), stop.clone());
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    () = stop2.cancelled() => return,
                    a = listener.accept() => a,
                };
                let Ok((client, _)) = accepted else {
                    continue;
                };
                let (generation, frozen) = {
                    let s = st.lock().expect("proxy state");
                    if !s.up {
                        continue; // dropping `client` refuses it
                    }
                    (s.generation.clone(), s.frozen.subscribe())
                };
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(target).await else {
                        return;
                    };
                    let (client_rx, client_tx) = client.into_split();
                    let (server_rx, server_tx) = server.into_split();
                    tokio::select! {
                        () = generation.cancelled() => {}
                        () = pump(client_rx, server_tx, frozen.clone()) => {}
                        () = pump(server_rx, client_tx, frozen) => {}
                    }
                });
            }
        });
        Self { addr, state, stop }
    }

    /// The broker "dies": live connections are cut, new ones refused.
    pub fn down(&self) {
        let mut s = self.state.lock().expect("proxy state");
        s.up = false;
        s.generation.cancel();
        s.generation = CancellationToken::new();
    }

    /// The broker is back.
    pub fn up(&self) {
        self.state.lock().expect("proxy state").up = true;
    }

    /// The broker stops answering but keeps every connection open, as one
    /// that blocks publishers on a memory or disk alarm stops reading them.
    pub fn freeze(&self) {
        self.state
            .lock()
            .expect("proxy state")
            .frozen
            .send_replace(true);
    }

    /// Bytes flow again, those held back first.
    pub fn thaw(&self) {
        self.state
            .lock()
            .expect("proxy state")
            .frozen
            .send_replace(false);
    }

    /// An AMQP URL that goes through this proxy.
    pub fn amqp_url(&self) -> String {
        let base = amqp_url();
        let (scheme_auth, rest) = base
            .split_once('@')
            .unwrap_or(("amqp://guest:guest", base.trim_start_matches("amqp://")));
        let vhost = rest.split_once('/').map_or("%2f", |(_, v)| v);
        format!("{scheme_auth}@{}/{vhost}", self.addr)
    }
}

/// Copies `from` to `to`, holding bytes back while `frozen`.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut frozen: tokio::sync::watch::Receiver<bool>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if frozen.wait_for(|f| !*f).await.is_err() {
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.stop.cancel();
        self.down();
    }
}

/// The database server's socket address from `DATABASE_URL`.
pub fn postgres_addr() -> SocketAddr {
    let opts = PgConnectOptions::from_str(&database_url()).expect("DATABASE_URL is a valid URL");
    let host = match opts.get_host() {
        "localhost" => "127.0.0.1",
        h if h.starts_with('/') => "127.0.0.1", // a socket directory: use TCP on the same port
        h => h,
    };
    format!("{host}:{}", opts.get_port())
        .parse()
        .expect("DATABASE_URL host is an IP address")
}

/// The broker's socket address from `AMQP_URL`.
pub fn broker_addr() -> SocketAddr {
    let url = amqp_url();
    let host_port = url.split_once('@').map_or(url.as_str(), |(_, r)| r);
    let host_port = host_port
        .trim_start_matches("amqp://")
        .split('/')
        .next()
        .unwrap_or("127.0.0.1:5672");
    let host_port = if host_port.contains(':') {
        host_port.to_owned()
    } else {
        format!("{host_port}:5672")
    };
    let host_port = host_port.replace("localhost", "127.0.0.1");
    host_port
        .parse()
        .expect("AMQP_URL host is an IP address and port")
}
