//! How a command reads its environment: [`Secret`] values that never
//! print, and [`env_conventions`] (values hidden in `--help`, and each
//! variable's `_FILE` twin).

pub use crate::secret::Secret;

/// The conventions of every command's environment, on every argument of
/// `cmd` and of its subcommands, so that an argument added later follows
/// them too:
/// - `--help` names the variable each argument reads, never its value: a
///   database URL's password or `JWT_SECRET` in the environment must not
///   reach a terminal, or a log that captured the help;
/// - each variable `X` has a twin `X_FILE`, the path of a file holding the
///   value (Docker's and Kubernetes' secrets), read when `X` is unset.
pub fn env_conventions(cmd: clap::Command) -> clap::Command {
    cmd.mut_args(|a| {
        let a = a.hide_env_values(true);
        let var = a.get_env().map(|v| v.to_string_lossy().into_owned());
        match var.and_then(|v| from_file(&v)) {
            Some(value) => a
                .default_value(&*Box::leak(value.into_boxed_str()))
                .hide_default_value(true),
            None => a,
        }
    })
    .mut_subcommands(env_conventions)
}

/// The value of `var`'s `_FILE` twin, when `var` itself is unset. Both set,
/// or a file that cannot be read, stops the start and says why: a secret
/// silently missing would start the service on a default.
fn from_file(var: &str) -> Option<String> {
    let path = std::env::var_os(format!("{var}_FILE"))?;
    let refuse = |kind, why: String| clap::Error::raw(kind, format!("{why}\n")).exit();
    if std::env::var_os(var).is_some() {
        refuse(
            clap::error::ErrorKind::ArgumentConflict,
            format!("{var} and {var}_FILE are both set; set one of them"),
        );
    }
    match std::fs::read_to_string(&path) {
        // A file written by `echo` ends with a newline that is not the value's.
        Ok(v) => Some(v.trim_end_matches(['\n', '\r']).to_owned()),
        Err(e) => refuse(
            clap::error::ErrorKind::Io,
            format!("{var}_FILE={}: {e}", path.to_string_lossy()),
        ),
    }
}
