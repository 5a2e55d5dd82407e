//! Order domain types. Each newtype checks its rule once, at construction,
//! so everything past the HTTP boundary holds valid values.

use contracts::Sku;

use crate::Error;

pub use contracts::OrderId;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CustomerId(String);

impl CustomerId {
    pub fn parse(s: String) -> Result<Self, Error> {
        let len = s.chars().count();
        if (1..=64).contains(&len) && !s.chars().any(char::is_control) {
            Ok(Self(s))
        } else {
            Err(Error::Invalid(
                "customer_id must be 1 to 64 characters, none of them control characters".into(),
            ))
        }
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Three upper-case ASCII letters (ISO 4217 shape).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Currency(String);

impl Currency {
    pub fn parse(s: String) -> Result<Self, Error> {
        if s.len() == 3 && s.bytes().all(|b| b.is_ascii_uppercase()) {
            Ok(Self(s))
        } else {
            Err(Error::Invalid(
                "currency must be three upper-case letters".into(),
            ))
        }
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Line {
    pub sku: Sku,
    pub quantity: i32,
    pub unit_price_cents: i64,
}

/// A valid order to place: 1 to 100 lines, quantities 1 to 10000, unit
/// prices 0 to 100000000 cents.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewOrder {
    pub customer_id: CustomerId,
    pub currency: Currency,
    pub lines: Vec<Line>,
}

impl NewOrder {
    pub fn total_cents(&self) -> i64 {
        // At most 100 × 10000 × 10^8 = 10^14: no overflow.
        self.lines
            .iter()
            .map(|l| i64::from(l.quantity) * l.unit_price_cents)
            .sum()
    }
}

pub fn line(sku: String, quantity: i64, unit_price_cents: i64) -> Result<Line, Error> {
    let sku = Sku::parse(sku).ok_or_else(|| Error::Invalid(Sku::RULE.into()))?;
    let quantity = i32::try_from(quantity)
        .ok()
        .filter(|q| (1..=10_000).contains(q))
        .ok_or_else(|| Error::Invalid("quantity must be 1 to 10000".into()))?;
    if !(0..=100_000_000).contains(&unit_price_cents) {
        return Err(Error::Invalid(
            "unit_price_cents must be 0 to 100000000".into(),
        ));
    }
    Ok(Line {
        sku,
        quantity,
        unit_price_cents,
    })
}

pub fn new_order(
    customer_id: String,
    currency: String,
    lines: Vec<Line>,
) -> Result<NewOrder, Error> {
    if !(1..=100).contains(&lines.len()) {
        return Err(Error::Invalid("an order has 1 to 100 lines".into()));
    }
    Ok(NewOrder {
        customer_id: CustomerId::parse(customer_id)?,
        currency: Currency::parse(currency)?,
        lines,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_of_the_contract_hold_at_the_edges() {
        assert!(line("SKU-1".into(), 1, 0).is_ok());
        assert!(line("SKU-1".into(), 10_000, 100_000_000).is_ok());
        assert!(line("SKU-1".into(), 0, 1).is_err());
        assert!(line("SKU-1".into(), 10_001, 1).is_err());
        assert!(line("SKU-1".into(), 1, -1).is_err());
        assert!(line("SKU-1".into(), 1, 100_000_001).is_err());
        assert!(line(String::new(), 1, 1).is_err());
        let one = || vec![line("A".into(), 1, 1).unwrap()];
        assert!(new_order("c".into(), "EUR".into(), one()).is_ok());
        assert!(new_order("c".into(), "eur".into(), one()).is_err());
        assert!(new_order("c".into(), "EURO".into(), one()).is_err());
        assert!(new_order(String::new(), "EUR".into(), one()).is_err());
        assert!(new_order("x".repeat(65), "EUR".into(), one()).is_err());
        assert!(new_order("c".into(), "EUR".into(), vec![]).is_err());
        assert!(
            new_order(
                "c".into(),
                "EUR".into(),
                vec![line("A".into(), 1, 1).unwrap(); 101]
            )
            .is_err()
        );
    }
}
