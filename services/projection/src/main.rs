use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    reliability::service::init_tracing();
    let settings = projection::Settings::parse();
    if settings.common.openapi {
        let api = reliability::service::openapi("projection", projection::http::router);
        println!("{}", serde_json::to_string_pretty(&api)?);
        return Ok(());
    }
    if !settings.rebuild_from.is_empty() {
        let report = projection::rebuild_from(&settings).await?;
        println!("{}", serde_json::to_string(&report)?);
        return Ok(());
    }
    let dbs =
        reliability::service::Databases::connect_lazy(&settings.database_url, &settings.common)?;
    let app = projection::build(settings, dbs, reliability::shutdown::token()).await?;
    Ok(app.run_until_stopped().await?)
}
