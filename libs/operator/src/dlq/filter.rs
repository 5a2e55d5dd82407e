//! Which dead letters an operator's re-drive or drop takes.

use super::DeadLetter;

/// Which dead letters a re-drive moves: all, one (by message id), a set
/// (by message ids: a group of one cause), or an event type; each given
/// field must match.
#[derive(Debug, Clone, Default)]
pub struct DeadLetterFilter {
    pub message_id: Option<String>,
    pub event_type: Option<String>,
    pub message_ids: Option<Vec<String>>,
}

impl DeadLetterFilter {
    pub fn matches(&self, letter: &DeadLetter) -> bool {
        let field = |want: &Option<String>, have: &Option<String>| {
            want.as_ref().is_none_or(|w| have.as_ref() == Some(w))
        };
        let among = self.message_ids.as_ref().is_none_or(|ids| {
            letter
                .message_id
                .as_ref()
                .is_some_and(|id| ids.contains(id))
        });
        field(&self.message_id, &letter.message_id)
            && field(&self.event_type, &letter.event_type)
            && among
    }
}
