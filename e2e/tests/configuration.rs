//! The configuration table (docs/configuration.md) against the settings
//! themselves: every variable a binary reads is in the table, and where
//! the table gives a default per variable, it is the one the `#[arg]`
//! declares (each default is written once, in code: issue 42).

use std::collections::BTreeMap;
use std::path::Path;

use clap::{Args, Command};

/// Every variable the services' settings read, with its declared default.
fn declared() -> BTreeMap<String, Option<String>> {
    let commands = [
        service_kit::service::CommonSettings::augment_args(Command::new("common")),
        graph::GraphSettings::augment_args(Command::new("graph")),
        projection::ProjectionSettings::augment_args(Command::new("projection")),
        payments::PspSettings::augment_args(Command::new("payments")),
    ];
    let mut vars = BTreeMap::new();
    for command in commands {
        for arg in command.get_arguments() {
            if let Some(env) = arg.get_env() {
                let default = arg
                    .get_default_values()
                    .first()
                    .map(|d| d.to_string_lossy().into_owned());
                vars.insert(env.to_string_lossy().into_owned(), default);
            }
        }
    }
    vars
}

/// The table's rows: each variable it names, and its default where the
/// row gives one per variable (`A`, `B` | `1`, `2`).
fn documented() -> BTreeMap<String, Option<String>> {
    let path = Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../docs/configuration.md"
    ));
    let text = std::fs::read_to_string(path).unwrap();
    let ticked = |cell: &str| -> Vec<String> {
        cell.split('`')
            .skip(1)
            .step_by(2)
            .map(str::to_owned)
            .collect()
    };
    let mut vars = BTreeMap::new();
    for line in text.lines().filter(|l| l.starts_with("| `")) {
        let cells: Vec<&str> = line.split(" | ").collect();
        let names: Vec<String> = ticked(cells[0].trim_start_matches("| "))
            .into_iter()
            .filter(|n| !n.contains('…'))
            .collect();
        let cell = cells.get(1).copied().unwrap_or_default();
        // A default cell's words before any explanation in brackets.
        let plain = cell.split(" (").next().unwrap_or_default();
        let defaults: Vec<String> = plain
            .split(", ")
            .map(|d| d.trim().trim_matches('`').to_owned())
            .collect();
        let exact = defaults.len() == names.len();
        for (i, name) in names.into_iter().enumerate() {
            vars.insert(name, exact.then(|| defaults[i].clone()));
        }
    }
    vars
}

/// How the table may write a declared default.
fn as_written(default: &str) -> Vec<String> {
    match default {
        "" => vec!["empty".into(), "unset".into()],
        d => vec![d.to_owned()],
    }
}

#[test]
fn every_setting_is_in_the_configuration_table_with_the_default_the_code_declares() {
    let documented = documented();
    let mut wrong = Vec::new();
    for (var, default) in declared() {
        match documented.get(&var) {
            None => wrong.push(format!("{var} is not in docs/configuration.md")),
            // A default the code computes (none declared) is the table's to describe.
            Some(Some(written))
                if default
                    .as_deref()
                    .is_some_and(|d| !as_written(d).contains(written)) =>
            {
                wrong.push(format!(
                    "{var}: the table says {written:?}, the code {default:?}"
                ))
            }
            Some(_) => {}
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}
