#[tokio::main]
async fn main() -> reliability::Result<()> {
    reliability::service::main(&__SERVICE__::SERVICE).await
}
