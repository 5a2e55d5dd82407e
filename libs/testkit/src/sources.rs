//! The three source services' databases (orders, inventory, payments),
//! migrated and holding the same few orders, for the derived views' tests
//! (verification and re-projection from the rows).

use sqlx::migrate::Migrator;

use crate::TestDb;

static ORDERS: Migrator = sqlx::migrate!("../../migrations/orders");
static INVENTORY: Migrator = sqlx::migrate!("../../migrations/inventory");
static PAYMENTS: Migrator = sqlx::migrate!("../../migrations/payments");

pub struct SourceDbs {
    pub orders: TestDb,
    pub inventory: TestDb,
    pub payments: TestDb,
}

impl SourceDbs {
    pub async fn cleanup(self) {
        for db in [self.orders, self.inventory, self.payments] {
            db.cleanup().await;
        }
    }
}

/// Fresh source databases whose rows say, every row a minute old:
/// - tenant 1, order 1: confirmed, stock committed, payment 11 captured
///   for 1000 with refund 5 of 300 succeeded;
/// - order 2: cancelled, stock released, payment 12 failed;
/// - order 3: cancelled, stock rejected (`no stock`);
/// - order 4: pending, stock reserved;
/// - tenant 2, order 1: pending, stock reserved.
///
/// Each is in EUR for 1000, with two lines (one for tenant 2). No
/// outbox holds an event.
pub async fn seeded_sources() -> SourceDbs {
    let orders = TestDb::with_migrations(&ORDERS).await;
    let inventory = TestDb::with_migrations(&INVENTORY).await;
    let payments = TestDb::with_migrations(&PAYMENTS).await;
    let past = "now() - interval '1 minute'";
    let statements = [
        (&orders, format!(
            "INSERT INTO orders (tenant_id, order_id, customer_id, currency, total_cents, status, created_at, updated_at)
             VALUES (1, 1, 'c1', 'EUR', 1000, 'confirmed', {past}, {past}),
                    (1, 2, 'c1', 'EUR', 1000, 'cancelled', {past}, {past}),
                    (1, 3, 'c2', 'EUR', 1000, 'cancelled', {past}, {past}),
                    (1, 4, 'c2', 'EUR', 1000, 'pending', {past}, {past}),
                    (2, 1, 'c1', 'EUR', 1000, 'pending', {past}, {past})")),
        (&orders, "INSERT INTO order_lines (tenant_id, order_id, line_no, sku, quantity, unit_price_cents)
             VALUES (1, 1, 1, 'A', 2, 100), (1, 1, 2, 'B', 1, 100), (1, 2, 1, 'B', 1, 100),
                    (1, 2, 2, 'C', 4, 100), (1, 3, 1, 'A', 1, 100), (1, 3, 2, 'D', 1, 100),
                    (1, 4, 1, 'A', 1, 100), (1, 4, 2, 'A', 2, 100), (2, 1, 1, 'A', 9, 100)".to_owned()),
        (&inventory, format!(
            "INSERT INTO reservations (tenant_id, order_id, status, reason, created_at, updated_at)
             VALUES (1, 1, 'committed', NULL, {past}, {past}), (1, 2, 'released', NULL, {past}, {past}),
                    (1, 3, 'rejected', 'no stock', {past}, {past}), (1, 4, 'reserved', NULL, {past}, {past}),
                    (2, 1, 'reserved', NULL, {past}, {past})")),
        (&payments, format!(
            "INSERT INTO payments (tenant_id, payment_id, order_id, customer_id, amount_cents, currency, status,
                                   refunded_cents, created_at, updated_at)
             VALUES (1, 11, 1, 'c1', 1000, 'EUR', 'captured', 300, {past}, {past}),
                    (1, 12, 2, 'c1', 1000, 'EUR', 'failed', 0, {past}, {past})")),
        (&payments, format!(
            "INSERT INTO refunds (tenant_id, refund_id, payment_id, amount_cents, status, created_at, updated_at)
             VALUES (1, 5, 11, 300, 'succeeded', {past}, {past})")),
    ];
    for (db, sql) in statements {
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .execute(&db.owner)
            .await
            .unwrap();
    }
    SourceDbs {
        orders,
        inventory,
        payments,
    }
}
