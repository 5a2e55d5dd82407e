#[tokio::main]
async fn main() -> reliability::Result<()> {
    reliability::service::main(&inventory::SERVICE).await
}
