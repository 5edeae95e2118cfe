//! Log-probabilities in OpenAI's two shapes: the completions API's parallel lists and the chat
//! API's per-token objects, with each token rendered through the model's tokenizer.
//!
//! They cover every token the model generated, a token per entry. Where a stop string ends the
//! request, that includes the token in which the stop begins (as vLLM reports them, and as
//! `usage.completion_tokens` counts): the text ends before the stop, so the last entries may
//! spell more than the text does.

use crate::api::{ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob};
use ponder::TokenLogprob;
use std::sync::Arc;
use tokenizers::Tokenizer;

/// JSON has no −∞; OpenAI reports a token of vanishing probability at this floor.
const FLOOR: f32 = -9999.0;

/// Renders tokens for one request (and, for completions, tracks each token's text offset).
pub struct Renderer {
    tokenizer: Option<Arc<Tokenizer>>,
    offset: usize,
}

impl Renderer {
    pub fn new(tokenizer: Option<Arc<Tokenizer>>) -> Self {
        Self { tokenizer, offset: 0 }
    }

    /// A token's text: its decoding alone, or `token_id:N` for a model served on ids.
    fn text(&self, id: u32) -> String {
        match self.tokenizer.as_deref().and_then(|t| ponder::tokenizer::decode(t, &[id], false).ok()) {
            Some(s) => s,
            None => format!("token_id:{id}"),
        }
    }

    fn top(&self, lp: &TokenLogprob) -> Vec<TopLogprob> {
        lp.top.iter().map(|&(id, v)| self.top_one(id, v)).collect()
    }

    fn top_one(&self, id: u32, logprob: f32) -> TopLogprob {
        let token = self.text(id);
        TopLogprob { bytes: token.as_bytes().to_vec(), token, logprob: logprob.max(FLOOR) }
    }

    /// The chat API's `logprobs.content` for `tokens`.
    pub fn chat(&self, tokens: &[(u32, TokenLogprob)]) -> ChatLogprobs {
        let content = tokens
            .iter()
            .map(|(id, lp)| {
                let TopLogprob { token, logprob, bytes } = self.top_one(*id, lp.logprob);
                ChatTokenLogprob { token, logprob, bytes, top_logprobs: self.top(lp) }
            })
            .collect();
        ChatLogprobs { content }
    }

    /// The completions API's lists for `tokens`, offsets continuing from the previous call.
    pub fn completion(&mut self, tokens: &[(u32, TokenLogprob)]) -> CompletionLogprobs {
        let mut out = CompletionLogprobs::default();
        for (id, lp) in tokens {
            let text = self.text(*id);
            out.text_offset.push(self.offset);
            self.offset += text.len();
            out.tokens.push(text);
            out.token_logprobs.push(lp.logprob.max(FLOOR));
            out.top_logprobs.push(self.top(lp).into_iter().map(|t| (t.token, t.logprob)).collect());
        }
        out
    }
}
