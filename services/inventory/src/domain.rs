//! Inventory's validated types.

use crate::Error;

/// 1 to 64 visible ASCII characters.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Sku(String);

impl Sku {
    pub fn parse(s: String) -> Result<Self, Error> {
        if (1..=64).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_graphic()) {
            Ok(Self(s))
        } else {
            Err(Error::Invalid(
                "sku must be 1 to 64 visible ASCII characters".into(),
            ))
        }
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
}
