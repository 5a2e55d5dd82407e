use graph::{SERVICE, Settings};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    reliability::service::init_tracing();
    let settings = Settings::from_env(&SERVICE);
    if !settings.service.rebuild_from.is_empty() {
        let report = graph::rebuild_from(&settings).await?;
        println!("{}", serde_json::to_string(&report)?);
        return Ok(());
    }
    Ok(reliability::service::run(&SERVICE, settings).await?)
}
