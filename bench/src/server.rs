//! The developer's PostgreSQL as production runs it, for the rounds of the
//! stack as processes: autovacuum on.
//!
//! This machine's server has it off (its CI config, `conf.d/90-ci.conf`).
//! Without it no table of a fresh stack is ever analyzed, so every cached
//! plan keeps the shape it took on the empty tables of the first seconds
//! (a sequential scan of the outbox for each relay claim), and each
//! published row leaves a dead entry in the pending index for every later
//! claim to walk. Session 41 measured the relays' PostgreSQL time per
//! decided order rising round by round that way, 2.3 to 10 ms. The
//! migrations tune the outbox's autovacuum for its churn (reliability
//! 0001); this lets it run.
//!
//! `autovacuum` takes a reload, not a restart. The setting goes back to
//! the server's own at the end (`ALTER SYSTEM RESET`); a bench killed
//! before that leaves it on, which costs the developer nothing. (An
//! `autovacuum = off` set by `ALTER SYSTEM` itself is reset with it, to
//! the configuration files' value.)

use sqlx::PgPool;

pub(crate) struct Autovacuum {
    turned_on: bool,
}

impl Autovacuum {
    /// Turns autovacuum on if the server has it off; says which.
    pub(crate) async fn on(admin: &PgPool) -> anyhow::Result<Self> {
        let setting: String = sqlx::query_scalar("SHOW autovacuum")
            .fetch_one(admin)
            .await?;
        let turned_on = setting == "off";
        if turned_on {
            alter(admin, "ALTER SYSTEM SET autovacuum = on").await?;
            println!("   autovacuum: on for these rounds (the server has it off)");
        }
        Ok(Self { turned_on })
    }

    /// What the table says of the server's autovacuum in these rounds.
    pub(crate) fn describe(&self) -> &'static str {
        if self.turned_on {
            "on for the rounds (the server's own setting is off)"
        } else {
            "on (the server's own setting)"
        }
    }

    /// The server's own setting again.
    pub(crate) async fn restore(self, admin: &PgPool) -> anyhow::Result<()> {
        if self.turned_on {
            alter(admin, "ALTER SYSTEM RESET autovacuum").await?;
        }
        Ok(())
    }
}

/// `statement`, an `ALTER SYSTEM`, and the reload that applies it.
async fn alter(admin: &PgPool, statement: &'static str) -> anyhow::Result<()> {
    sqlx::query(statement).execute(admin).await?;
    sqlx::query("SELECT pg_reload_conf()")
        .execute(admin)
        .await?;
    Ok(())
}
