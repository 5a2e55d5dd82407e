#[tokio::main]
async fn main() -> reliability::Result<()> {
    service_kit::service::main(&inventory::SERVICE).await
}
