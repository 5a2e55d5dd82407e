//! `sqlx::migrate!` copies the migrations into the binary when the crate
//! compiles, but cargo knows nothing of that directory: without this, a new
//! or edited migration leaves a built binary with the old set.
fn main() {
    println!("cargo:rerun-if-changed=../../migrations/reliability");
}
