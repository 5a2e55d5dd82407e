#[tokio::main]
async fn main() -> reliability::Result<()> {
    reliability::service::main(&orders::SERVICE).await
}
