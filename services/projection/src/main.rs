use projection::{SERVICE, Settings};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // `projection verify …`: an operator's one pass; anything else runs a role.
    if std::env::args().nth(1).as_deref() == Some("verify") {
        let agrees = projection::cli::verify(std::env::args().skip(1)).await?;
        std::process::exit(if agrees { 0 } else { 1 });
    }
    service_kit::service::init_tracing();
    let settings = Settings::from_env(&SERVICE);
    if !settings.service.rebuild_from.is_empty() {
        let report = projection::rebuild_from(&settings).await?;
        println!("{}", serde_json::to_string(&report)?);
        return Ok(());
    }
    Ok(service_kit::service::run(&SERVICE, settings).await?)
}
