#[tokio::main]
async fn main() -> reliability::Result<()> {
    service_kit::service::main(&__SERVICE__::SERVICE).await
}
