//! The defaults of a settings struct, read from where they are written.

/// What an empty environment parses to for settings `X`: what clap reads
/// from no arguments with every variable's lookup taken away, so the
/// defaults written in `X`'s `#[arg]`s. `CommonSettings::local`, the auth
/// settings' and a service's own settings' `Default` are this: no default
/// is written twice.
pub fn defaults<X: clap::Args + clap::FromArgMatches>() -> X {
    let command = X::augment_args(clap::Command::new("defaults"))
        .mut_args(|arg| arg.env(None::<&'static str>));
    let matches = command
        .try_get_matches_from(["defaults"])
        .expect("every setting has a default or is optional");
    X::from_arg_matches(&matches).expect("the defaults parse")
}
