#[tokio::main]
async fn main() -> reliability::Result<()> {
    reliability::service::main(&payments::SERVICE).await
}
