//! Incremental detokenization with stop-string hold-back.

use tokenizers::Tokenizer;

/// Turns a growing list of token ids into text deltas. Text that could be the start of a stop
/// string is held back until it is known not to be one.
#[derive(Debug, Default)]
pub struct Detokenizer {
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    /// All text decoded so far.
    text: String,
    /// Bytes of `text` already handed out.
    emitted: usize,
}

/// Result of pushing a token.
#[derive(Debug, PartialEq, Eq)]
pub enum Pushed {
    Text(String),
    /// A stop string was found; carries the text before it not yet emitted.
    Stopped {
        text: String,
        stop: String,
    },
    /// The tokenizer could not decode the tokens (an error, or a panic it raised).
    Failed(String),
}

impl Detokenizer {
    pub fn push(&mut self, token: u32, tokenizer: Option<&Tokenizer>, stop: &[String]) -> Pushed {
        self.ids.push(token);
        if let Some(tok) = tokenizer {
            let decoded = crate::tokenizer::decode(tok, &self.ids[self.prefix_offset..self.read_offset], true)
                .and_then(|prefix| Ok((prefix, crate::tokenizer::decode(tok, &self.ids[self.prefix_offset..], true)?)));
            let (prefix, full) = match decoded {
                Ok(texts) => texts,
                Err(e) => return Pushed::Failed(e),
            };
            // A trailing U+FFFD means an incomplete UTF-8 sequence: wait for more tokens.
            if full.len() > prefix.len() && !full.ends_with('\u{FFFD}') && full.starts_with(&prefix) {
                self.text.push_str(&full[prefix.len()..]);
                self.prefix_offset = self.read_offset;
                self.read_offset = self.ids.len();
            }
        }
        if let Some((pos, s)) = find_stop(&self.text, stop, self.emitted) {
            let out = self.text[self.emitted..pos].to_string();
            self.text.truncate(pos);
            self.emitted = pos;
            return Pushed::Stopped { text: out, stop: s.to_string() };
        }
        let safe = self.text.len() - held_suffix(&self.text[self.emitted..], stop);
        let out = self.text[self.emitted..safe].to_string();
        self.emitted = safe;
        Pushed::Text(out)
    }

    /// Everything not yet emitted (at the end of a request).
    pub fn flush(&mut self) -> String {
        let out = self.text[self.emitted..].to_string();
        self.emitted = self.text.len();
        out
    }
}

/// Earliest stop string occurrence that ends past `emitted` (stop strings can span deltas).
fn find_stop<'a>(text: &str, stop: &'a [String], emitted: usize) -> Option<(usize, &'a str)> {
    let mut best: Option<(usize, &str)> = None;
    for s in stop.iter().filter(|s| !s.is_empty()) {
        let from = floor_char_boundary(text, emitted.saturating_sub(s.len()));
        if let Some(i) = text[from..].find(s.as_str()) {
            let pos = from + i;
            if best.is_none_or(|(b, _)| pos < b) {
                best = Some((pos, s));
            }
        }
    }
    best
}

/// Length in bytes of the longest suffix of `tail` that is a proper prefix of a stop string.
fn held_suffix(tail: &str, stop: &[String]) -> usize {
    let mut held = 0;
    for s in stop {
        for (i, _) in tail.char_indices() {
            let suffix = &tail[i..];
            if suffix.len() < s.len() && s.starts_with(suffix) {
                held = held.max(suffix.len());
                break;
            }
        }
    }
    held
}

fn floor_char_boundary(s: &str, mut i: usize) -> usize {
    while i > 0 && !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_suffix_held_back() {
        assert_eq!(held_suffix("hello wor", &["world".into()]), 3);
        assert_eq!(held_suffix("hello", &["xyz".into()]), 0);
        assert_eq!(find_stop("abc STOP def", &["STOP".into()], 0), Some((4, "STOP")));
    }
}
