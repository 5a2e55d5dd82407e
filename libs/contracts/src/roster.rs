//! The services of this repository, as `services/roster.txt` lists them:
//! the one list the CLI, e2e and the bench read (the scripts and the
//! compose check read the file itself).

use std::sync::LazyLock;

/// One service of the roster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Service {
    pub name: &'static str,
    /// Its API port (`make up`'s; the ops port is this + 3000).
    pub port: u16,
    /// It publishes events: it has an outbox, and a relay runs for it.
    pub outbox: bool,
}

const ROSTER: &str = include_str!("../../../services/roster.txt");

static SERVICES: LazyLock<Vec<Service>> =
    LazyLock::new(|| parse(ROSTER).unwrap_or_else(|e| panic!("services/roster.txt: {e}")));

/// Every service, in the roster's order (the saga's).
pub fn services() -> &'static [Service] {
    &SERVICES
}

/// Every service's name, in the roster's order.
pub fn names() -> Vec<&'static str> {
    SERVICES.iter().map(|s| s.name).collect()
}

fn parse(text: &'static str) -> Result<Vec<Service>, String> {
    let mut services: Vec<Service> = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or_default().trim();
        if line.is_empty() {
            continue;
        }
        let fields: Vec<&'static str> = line.split_whitespace().collect();
        let [name, port, outbox] = fields[..] else {
            return Err(format!("line {}: want `name port yes|no`", n + 1));
        };
        let port = port
            .parse()
            .map_err(|e| format!("line {}: port {port}: {e}", n + 1))?;
        let outbox = match outbox {
            "yes" => true,
            "no" => false,
            other => return Err(format!("line {}: outbox `{other}`: yes or no", n + 1)),
        };
        if services.iter().any(|s| s.name == name || s.port == port) {
            return Err(format!("line {}: {name} or port {port} twice", n + 1));
        }
        services.push(Service { name, port, outbox });
    }
    Ok(services)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_roster_names_every_service_crate_and_only_those() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../services");
        let mut crates: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.join("Cargo.toml").exists())
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            // The provider's simulator stands in for a third party.
            .filter(|name| name != "psp-sim")
            .collect();
        crates.sort();
        let mut listed: Vec<String> = names().into_iter().map(str::to_owned).collect();
        listed.sort();
        assert_eq!(listed, crates, "services/roster.txt against services/*/");
    }

    #[test]
    fn a_malformed_roster_says_where() {
        assert!(parse("a 1 yes\nb 2").unwrap_err().contains("line 2"));
        assert!(parse("a 1 maybe").unwrap_err().contains("yes or no"));
        assert!(parse("a 1 yes\nb 1 no").unwrap_err().contains("twice"));
        assert_eq!(
            parse("# c\n\na 8 no # x\n").unwrap(),
            [Service {
                name: "a",
                port: 8,
                outbox: false
            }]
        );
    }
}
