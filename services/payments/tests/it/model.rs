//! A model-based test of the payment and refund state machine (I4), against
//! the real PostgreSQL and the real simulator. Each seed draws a schedule:
//! provider answers (2xx, 4xx, 5xx after charging, a hang after charging,
//! pending then final, a late landing), crashes before the call, after it
//! and in the record transaction, a lease that expires under a second
//! worker, a worker frozen before its call lands until the payment has
//! failed and its refund by key found nothing, deadlines, partial refunds,
//! and time passing. After quiescence
//! and one reconciliation, for every payment key the money at the provider
//! must be what the order's fate says: the amount less our refunds if the
//! payment was captured (the order confirmed), 0 if it failed (cancelled),
//! at most one charge, and no refund beyond its charge; and since the
//! simulated provider keeps its processing bound, reconciliation must find
//! nothing to repair.
//!
//! `MODEL_SEEDS=N` runs N seeds (default 200), `MODEL_SEED=S` replays one.
//! Time is simulated: "time passes" moves our timestamps back and lets the
//! provider finish what it was processing, so no step sleeps.

use std::time::{Duration, Instant};

use payments::provider::Psp;
use payments::reconcile::Reconciler;
use payments::worker::{
    AFTER_PROVIDER, BEFORE_PROVIDER, BEFORE_RECORD_COMMIT, Worker, WorkerConfig,
};
use psp_sim::Faults;
use reliability::failpoint::{Action, FailPoints};

use crate::TestApp;

/// The provider's processing bound as the worker is told it; "time
/// passes" moves everything back by more than this.
const GRACE: Duration = Duration::from_secs(60);
const DEADLINE: Duration = Duration::from_secs(300);
/// The client gives up on a hung call after this.
const TIMEOUT: Duration = Duration::from_millis(120);
const PAYMENTS: i64 = 3;

/// SplitMix64: a seeded schedule, the same on every machine.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        (z ^ (z >> 31)) % n
    }
}

/// A worker of its own (its own fail points), sharing one HTTP client.
fn worker(s: &Seed<'_>, deadline: Duration, fail_points: FailPoints) -> Worker {
    worker_on(s, &s.psp, deadline, fail_points)
}

fn worker_on(s: &Seed<'_>, psp: &Psp, deadline: Duration, fail_points: FailPoints) -> Worker {
    Worker::new(
        s.app.db.app.clone(),
        psp.clone(),
        config(deadline),
        fail_points,
    )
}

fn config(deadline: Duration) -> WorkerConfig {
    // One call per pass: which call a fail point hits, and in what order
    // work is claimed, are then the seed's alone, so a seed replays exactly.
    WorkerConfig {
        deadline,
        grace: GRACE,
        max_backoff: Duration::ZERO,
        max_in_flight: 1,
        ..WorkerConfig::default()
    }
}

fn crash_at(point: &str) -> FailPoints {
    let points = FailPoints::none();
    points.arm(point, Action::Error);
    points
}

/// One worker pass; a fail point's "crash" is what the step is about.
async fn pass(w: &Worker) {
    let _ = w.process_due().await;
}

/// The next provider call(s) behave like this.
fn draw_fault(rng: &mut Rng) -> (&'static str, Faults) {
    let hang = || Faults {
        hang_ms: 200,
        ..Faults::default()
    };
    match rng.below(9) {
        0 => (
            "503 before charging",
            Faults {
                fail_next: 1,
                ..Faults::default()
            },
        ),
        1 => (
            "charge then 500",
            Faults {
                charge_then_fail_next: 1,
                ..Faults::default()
            },
        ),
        2 => (
            "charge then hang",
            Faults {
                charge_then_hang_next: 1,
                ..hang()
            },
        ),
        3 => (
            "4xx refusal",
            Faults {
                reject_next: 1 + rng.below(2) as u32,
                ..Faults::default()
            },
        ),
        4 => (
            "pending then succeeded",
            Faults {
                pending_next: 1,
                settle_ms: 3_600_000,
                ..Faults::default()
            },
        ),
        5 => (
            "pending then failed",
            Faults {
                pending_fail_next: 1,
                settle_ms: 3_600_000,
                ..Faults::default()
            },
        ),
        6 => (
            "lands after the caller gave up",
            Faults {
                land_late_next: 1,
                land_after_ms: 3_600_000,
                ..hang()
            },
        ),
        _ => ("2xx", Faults::default()),
    }
}

struct Seed<'a> {
    app: &'a TestApp,
    psp: Psp,
    /// For quiescence and reconciliation, which are not under test: a
    /// timeout no load on the test machine reaches.
    calm: Psp,
    tenant: i64,
    log: Vec<String>,
}

impl Seed<'_> {
    /// Time passes beyond the lease, the backoff and the provider's
    /// processing bound: everything in flight at the provider lands.
    async fn time_passes(&self) {
        self.app.psp.settle_all();
        let secs = GRACE.as_secs_f64() + 1.0;
        for sql in [
            "UPDATE payments SET next_attempt_at = created_at,
                    first_attempt_at = first_attempt_at - make_interval(secs => $2),
                    sent_at = sent_at - make_interval(secs => $2),
                    prev_sent_at = prev_sent_at - make_interval(secs => $2),
                    doubt_sent_at = doubt_sent_at - make_interval(secs => $2)
             WHERE tenant_id = $1",
            "UPDATE refunds SET next_attempt_at = created_at,
                    sent_at = sent_at - make_interval(secs => $2),
                    doubt_sent_at = doubt_sent_at - make_interval(secs => $2)
             WHERE tenant_id = $1",
        ] {
            sqlx::query(sql)
                .bind(self.tenant)
                .bind(secs)
                .execute(&self.app.db.owner)
                .await
                .unwrap();
        }
    }

    /// A lease runs out (a worker died or hangs), nothing else. Work comes
    /// due in the order it was created, never by id: ids depend on how many
    /// seeds ran before, and a seed must replay alone as it ran among others.
    async fn leases_expire(&self) {
        for sql in [
            "UPDATE payments SET next_attempt_at = created_at WHERE tenant_id = $1 AND status = 'pending'",
            "UPDATE refunds SET next_attempt_at = created_at WHERE tenant_id = $1 AND status = 'pending'",
        ] {
            sqlx::query(sql)
                .bind(self.tenant)
                .execute(&self.app.db.owner)
                .await
                .unwrap();
        }
    }

    async fn open_work(&self) -> i64 {
        sqlx::query_scalar(
            "SELECT (SELECT count(*) FROM payments WHERE tenant_id = $1 AND status = 'pending')
                  + (SELECT count(*) FROM refunds WHERE tenant_id = $1 AND status = 'pending')",
        )
        .bind(self.tenant)
        .fetch_one(&self.app.db.owner)
        .await
        .unwrap()
    }

    /// A partial refund of a captured payment, through the API.
    async fn refund_request(&mut self, rng: &mut Rng, step: usize) {
        let captured: Vec<(i64, i64)> = sqlx::query_as(
            "SELECT payment_id, amount_cents - refunded_cents FROM payments
             WHERE tenant_id = $1 AND status = 'captured' AND refunded_cents < amount_cents ORDER BY payment_id",
        )
        .bind(self.tenant)
        .fetch_all(&self.app.db.owner)
        .await
        .unwrap();
        if captured.is_empty() {
            return;
        }
        let (payment_id, left) = captured[rng.below(captured.len() as u64) as usize];
        let amount = 1 + rng.below(left as u64) as i64;
        let body =
            serde_json::json!({"payment_id": payment_id, "amount_cents": amount}).to_string();
        let (status, _, _) = self
            .app
            .api
            .post(self.tenant, "/refunds", &format!("model-{step}"), &body)
            .await;
        self.log
            .push(format!("refund {amount} of payment {payment_id}: {status}"));
    }

    /// Claims made so far, over this tenant's payments and refunds.
    async fn attempts(&self) -> i64 {
        sqlx::query_scalar(
            "SELECT (SELECT coalesce(sum(attempts), 0) FROM payments WHERE tenant_id = $1)
                  + (SELECT coalesce(sum(attempts), 0) FROM refunds WHERE tenant_id = $1)",
        )
        .bind(self.tenant)
        .fetch_one(&self.app.db.owner)
        .await
        .unwrap()
    }

    /// A worker claims, then stalls before its request reaches the
    /// provider (held in a frozen proxy): its lease runs out, the deadline
    /// fails the payment, time passes until the refund by key finds
    /// nothing, and only then does the request land. The request's
    /// `X-Not-After` (its lease end) must keep it from charging.
    async fn frozen_worker(&self) {
        let target = self.app.psp_url.trim_start_matches("http://");
        let proxy =
            testkit::TcpProxy::start(target.parse().expect("the simulator's address")).await;
        proxy.freeze();
        // A short lease in real time: simulated time does not move the
        // provider's clock. The call waits out the freeze.
        let psp = Psp::new(&format!("http://{}", proxy.addr), Duration::from_secs(30));
        let lease = Duration::from_millis(1);
        let config = WorkerConfig {
            lease,
            ..config(DEADLINE)
        };
        let frozen = Worker::new(self.app.db.app.clone(), psp, config, FailPoints::none());
        self.leases_expire().await;
        let before = self.attempts().await;
        let stalled = tokio::spawn(async move { frozen.process_due().await });
        let until = Instant::now() + Duration::from_secs(5);
        while self.attempts().await == before && !stalled.is_finished() {
            assert!(Instant::now() < until, "the frozen worker never claimed");
            tokio::task::yield_now().await;
        }
        pass(&worker(self, Duration::ZERO, FailPoints::none())).await;
        for _ in 0..3 {
            self.time_passes().await;
            pass(&worker(self, DEADLINE, FailPoints::none())).await;
        }
        proxy.thaw();
        let _ = stalled.await;
    }

    /// A worker claims and hangs on the provider; its lease runs out and a
    /// second worker takes the same work while the first is still waiting.
    async fn second_worker(&self) {
        self.app.psp.set_faults(Faults {
            charge_then_hang_next: 1,
            hang_ms: 200,
            ..Faults::default()
        });
        self.leases_expire().await;
        let first = worker(self, DEADLINE, FailPoints::none());
        let slow = tokio::spawn(async move { first.process_due().await });
        let until = Instant::now() + Duration::from_secs(5);
        let mine = |psp: &psp_sim::Simulator| {
            psp.in_flight(&format!("pay-{}", self.tenant))
                + psp.in_flight(&format!("refund-{}", self.tenant))
        };
        while mine(&self.app.psp) == 0 && !slow.is_finished() && Instant::now() < until {
            tokio::task::yield_now().await;
        }
        self.leases_expire().await;
        pass(&worker(self, DEADLINE, FailPoints::none())).await;
        let _ = slow.await;
    }

    async fn step(&mut self, rng: &mut Rng, step: usize) {
        let normal = worker(self, DEADLINE, FailPoints::none());
        let what = match rng.below(13) {
            0..=2 => {
                let (what, faults) = draw_fault(rng);
                self.app.psp.set_faults(faults);
                what.to_owned()
            }
            3..=4 => {
                pass(&normal).await;
                "worker pass".into()
            }
            5 => {
                pass(&worker(self, DEADLINE, crash_at(BEFORE_PROVIDER))).await;
                "crash before the call".into()
            }
            6 => {
                pass(&worker(self, DEADLINE, crash_at(AFTER_PROVIDER))).await;
                "crash after the call, before the record".into()
            }
            7 => {
                pass(&worker(self, DEADLINE, crash_at(BEFORE_RECORD_COMMIT))).await;
                "the record transaction fails".into()
            }
            8 => {
                self.second_worker().await;
                "lease expires under a second worker".into()
            }
            9 => {
                pass(&worker(self, Duration::ZERO, FailPoints::none())).await;
                "deadline passes".into()
            }
            10 => {
                self.refund_request(rng, step).await;
                "refund request".into()
            }
            11 => {
                self.frozen_worker().await;
                "a worker frozen before its call, past the grace".into()
            }
            _ => {
                if rng.below(2) == 0 {
                    self.leases_expire().await;
                    "leases expire".into()
                } else {
                    self.time_passes().await;
                    "time passes".into()
                }
            }
        };
        self.log.push(what);
    }

    /// No faults, time passing, until nothing of this tenant is open.
    async fn quiesce(&self) -> Result<(), String> {
        self.app.psp.set_faults(Faults::default());
        let w = worker_on(self, &self.calm, DEADLINE, FailPoints::none());
        for _ in 0..40 {
            self.time_passes().await;
            for _ in 0..50 {
                if !w.process_due().await.is_ok_and(|n| n > 0) {
                    break;
                }
            }
            if self.open_work().await == 0 && !self.app.psp.busy() {
                return Ok(());
            }
        }
        Err("still open after 40 rounds of quiescence".into())
    }

    async fn check(&self) -> Result<(), String> {
        let payments: Vec<(i64, String, i64, i64, i64)> = sqlx::query_as(
            "SELECT p.payment_id, p.status, p.amount_cents, p.refunded_cents,
                    (SELECT coalesce(sum(r.amount_cents), 0)::bigint FROM refunds r
                     WHERE r.tenant_id = p.tenant_id AND r.payment_id = p.payment_id AND r.status = 'succeeded')
             FROM payments p WHERE p.tenant_id = $1 ORDER BY p.payment_id",
        )
        .bind(self.tenant)
        .fetch_all(&self.app.db.owner)
        .await
        .unwrap();
        let ledger = self.app.psp.money();
        let mut wrong = Vec::new();
        for (payment_id, status, amount, reserved, refunded) in payments {
            let key = format!("pay-{}-{payment_id}", self.tenant);
            let (charged, back, times) =
                ledger.iter().find(|m| m.key == key).map_or((0, 0, 0), |m| {
                    (m.charged_cents, m.refunded_cents, m.times_charged)
                });
            let expected = match status.as_str() {
                "captured" => amount - refunded,
                _ => 0,
            };
            if charged - back != expected {
                wrong.push(format!(
                    "{key} is {status}: the provider holds {} (charged {charged}, refunded {back}), expected {expected}",
                    charged - back
                ));
            }
            if times > 1 || back > charged {
                wrong.push(format!(
                    "{key}: charged {times} times, refunded {back} of {charged}"
                ));
            }
            if reserved != refunded {
                wrong.push(format!(
                    "{key}: refunded_cents {reserved}, succeeded refunds {refunded}"
                ));
            }
        }
        if wrong.is_empty() {
            Ok(())
        } else {
            Err(wrong.join("; "))
        }
    }
}

async fn run_seed(app: &TestApp, psp: &Psp, lists: &Psp, seed: u64) -> Result<(), String> {
    let started = Instant::now();
    let mut rng = Rng(seed);
    let mut s = Seed {
        app,
        psp: psp.clone(),
        calm: lists.clone(),
        tenant: 1000 + seed as i64,
        log: Vec::new(),
    };
    for order in 1..=PAYMENTS {
        let customer = if rng.below(10) == 0 {
            "decline-1"
        } else {
            "c-1"
        };
        let amount = 100 * (1 + rng.below(9) as i64);
        app.reserve(s.tenant, order, customer, amount).await;
    }
    let steps = 8 + rng.below(16) as usize;
    for step in 0..steps {
        s.step(&mut rng, step).await;
    }
    let result = async {
        s.quiesce().await?;
        let reconciler = Reconciler::new(
            app.db.owner.clone(),
            lists.clone(),
            // This seed's own charges: the provider's clock is not moved.
            started.elapsed() + Duration::from_secs(1),
        );
        let report = reconciler.run_once(true).await.map_err(|e| e.to_string())?;
        // The simulated provider always keeps its processing bound, so the
        // worker alone must leave nothing to find: a repair here is a bug
        // of ours that reconciliation hid (reconcile.rs has its own test).
        let found: Vec<_> = report
            .mismatches
            .iter()
            .filter(|m| m.key.contains(&format!("-{}-", s.tenant)))
            .collect();
        if !found.is_empty() {
            return Err(format!("reconciliation found {found:?}"));
        }
        s.quiesce().await?;
        s.check().await
    }
    .await;
    result.map_err(|e| format!("{e}\n  schedule: {}", s.log.join(" | ")))
}

#[tokio::test]
async fn money_follows_the_order_under_any_schedule_of_crashes_and_provider_answers() {
    let app = TestApp::spawn().await;
    let psp = Psp::new(&app.psp_url, TIMEOUT);
    // Reconciliation's list calls are not under test: no short timeout.
    let lists = Psp::new(&app.psp_url, Duration::from_secs(10));
    let seeds: Vec<u64> = match std::env::var("MODEL_SEED") {
        Ok(one) => vec![one.parse().expect("MODEL_SEED is a number")],
        Err(_) => {
            let n = std::env::var("MODEL_SEEDS").map_or(200, |n| n.parse().expect("MODEL_SEEDS"));
            (1..=n).collect()
        }
    };
    let started = Instant::now();
    let mut failed = Vec::new();
    for &seed in &seeds {
        if let Err(e) = run_seed(&app, &psp, &lists, seed).await {
            eprintln!("seed {seed} failed (replay: MODEL_SEED={seed}): {e}");
            failed.push(seed);
            if failed.len() >= 5 {
                break;
            }
        }
    }
    eprintln!(
        "{} seeds in {:.1}s, {} failed",
        seeds.len(),
        started.elapsed().as_secs_f64(),
        failed.len()
    );
    assert!(
        failed.is_empty(),
        "failing seeds: {failed:?} (MODEL_SEED=N replays one)"
    );
    app.stop().await;
}
