#[tokio::main]
async fn main() -> reliability::Result<()> {
    // `payments reconcile …`: an operator's one pass; anything else runs a role.
    if std::env::args().nth(1).as_deref() == Some("reconcile") {
        return payments::cli::reconcile(std::env::args().skip(1)).await;
    }
    service_kit::service::main(&payments::SERVICE).await
}
