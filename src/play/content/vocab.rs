//! The model's vocabulary: what the engine needs to write readable text, structured outputs
//! and tool calls in the token ids of the model the frontend serves.
//!
//! A [`Vocabulary`] is loaded once per process from a model directory's `tokenizer.json`
//! (`play --tokenizer DIR`; `serve` passes its model directory), or from the tiny model
//! embedded in this binary when no directory is given. It holds Hugging Face's own tokenizer
//! (to encode text the way the frontend would), the bytes of every token, and the
//! [`ParserFactory`]s that turn a structured-output constraint into allowed-token masks.
//!
//! There are two factories because vLLM's xgrammar backend compiles over two views of the
//! vocabulary ([`Specials`]): structural tags and Lark grammars over the whole of it, where a
//! special token such as gpt-oss's `<|channel|>` is matched by its text (how a model whose
//! markup markers are special tokens writes them under a tag), and JSON schemas, regexes,
//! choices and GBNF without special tokens, which such text then spells in ordinary ones.

use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::{Arc, OnceLock};

use anyhow::{Context, Result, anyhow};
use llguidance::ParserFactory;
use llguidance::toktrie::{InferenceCapabilities, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};

/// Which tokens a grammar's literal text can match (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Specials {
    /// No special token: text that spells one is written in ordinary tokens.
    Apart,
    /// Every special token but the end-of-sequence one, by its text.
    AsText,
}

/// A model's tokens, and what they spell.
pub struct Vocabulary {
    env: TokEnv,
    factory: ParserFactory,
    /// The factory over [`Specials::AsText`].
    factory_as_text: ParserFactory,
    tokenizer: Arc<tokenizers::Tokenizer>,
    /// Whether each token's bytes hold a `<`: [`Self::text_contains`] skips the others
    /// without reading them.
    has_lt: Vec<bool>,
    /// The model's end-of-sequence id (generation_config.json, else tokenizer_config.json).
    pub eos: u32,
    /// Where it came from, for logs.
    pub source: String,
}

impl std::fmt::Debug for Vocabulary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vocabulary")
            .field("source", &self.source)
            .field("size", &self.size())
            .field("eos", &self.eos)
            .finish()
    }
}

/// The tokenizer as llguidance sees it: the token trie (special tokens marked, or some of
/// them as their text: [`Specials`]), and the frontend's tokenization.
struct Env {
    trie: TokTrie,
    tokenizer: Arc<tokenizers::Tokenizer>,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// The frontend's tokenization, except that a token this trie marks special, which no
    /// text matches, is spelled in ordinary tokens: llguidance forces the tokens of text
    /// the grammar fixes, and the marked token would not satisfy it.
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        let Some(ids) = hf_encode(&self.tokenizer, s) else {
            return self.trie.greedy_tokenize(s);
        };
        if !ids.iter().any(|&t| self.trie.is_special_token(t)) {
            return ids;
        }
        let mut out = Vec::with_capacity(ids.len());
        for t in ids {
            match self
                .trie
                .token(t)
                .strip_prefix(&[TokTrie::SPECIAL_TOKEN_MARKER])
            {
                Some(text) => out.extend(self.trie.greedy_tokenize(text)),
                None => out.push(t),
            }
        }
        out
    }
}

/// `s` as Hugging Face's tokenizer encodes it (special tokens matched, none added); `None`
/// when it cannot.
fn hf_encode(tokenizer: &tokenizers::Tokenizer, s: &[u8]) -> Option<Vec<u32>> {
    let text = std::str::from_utf8(s).ok()?;
    let enc = tokenizer.encode_fast(text, false).ok()?;
    Some(enc.get_ids().to_vec())
}

impl Vocabulary {
    /// The vocabulary of the tiny model embedded in this binary (what `serve` serves by
    /// default), built once per process.
    pub fn embedded() -> Arc<Vocabulary> {
        static EMBEDDED: OnceLock<Arc<Vocabulary>> = OnceLock::new();
        EMBEDDED
            .get_or_init(|| {
                let json = vcr_host::tiny_model::tokenizer_json_text();
                Arc::new(
                    Self::from_json(
                        &json,
                        vcr_host::tiny_model::EOS_TOKEN_ID,
                        "the embedded tiny model",
                    )
                    .expect("the embedded tokenizer loads"),
                )
            })
            .clone()
    }

    /// Load `dir/tokenizer.json`; the EOS id comes from `generation_config.json` (its first
    /// `eos_token_id`) or `tokenizer_config.json` (`eos_token`).
    pub fn load(dir: &Path) -> Result<Vocabulary> {
        let path = dir.join("tokenizer.json");
        let json = std::fs::read_to_string(&path)
            .with_context(|| format!("--tokenizer: cannot read {}", path.display()))?;
        let probe = tokenizers::Tokenizer::from_str(&json).map_err(|e| {
            anyhow!(
                "--tokenizer: {} is not a tokenizer.json: {e}",
                path.display()
            )
        })?;
        let eos = eos_of(dir, &probe).ok_or_else(|| {
            anyhow!(
                "--tokenizer: {} names no EOS token (generation_config.json eos_token_id, or tokenizer_config.json eos_token)",
                dir.display()
            )
        })?;
        Self::from_json(&json, eos, &dir.display().to_string())
    }

    fn from_json(json: &str, eos: u32, source: &str) -> Result<Vocabulary> {
        let tokenizer = Arc::new(
            tokenizers::Tokenizer::from_str(json)
                .map_err(|e| anyhow!("{source}: tokenizer.json: {e}"))?,
        );
        let value: serde_json::Value = serde_json::from_str(json)?;
        let mut words = llguidance::token_bytes_from_tokenizer_json(&value)
            .map_err(|e| anyhow!("{source}: cannot read the bytes of its tokens: {e}"))?;
        let size = tokenizer.get_vocab_size(true).max(words.len());
        words.resize(size, Vec::new());
        let has_lt = words.iter().map(|w| w.contains(&b'<')).collect();
        let info = TokRxInfo::new(size as u32, eos);
        let factory_of = |words: &[Vec<u8>]| -> Result<(TokEnv, ParserFactory)> {
            let env: TokEnv = Arc::new(Env {
                trie: TokTrie::from(&info, words),
                tokenizer: tokenizer.clone(),
            });
            let mut factory = ParserFactory::new(
                &env,
                InferenceCapabilities {
                    ff_tokens: true,
                    ..Default::default()
                },
                &[],
            )
            .map_err(|e| anyhow!("{source}: {e}"))?;
            factory.quiet();
            Ok((env, factory))
        };
        let (env, factory) = factory_of(&words)?;
        // as xgrammar reads a vocabulary: a special token is its text, the stop token none
        for (id, w) in words.iter_mut().enumerate() {
            if id != eos as usize && w.first() == Some(&TokTrie::SPECIAL_TOKEN_MARKER) {
                w.remove(0);
            }
        }
        let (_, factory_as_text) = factory_of(&words)?;
        Ok(Vocabulary {
            env,
            factory,
            factory_as_text,
            tokenizer,
            has_lt,
            eos,
            source: source.to_string(),
        })
    }

    /// Number of token ids.
    pub fn size(&self) -> u32 {
        self.env.tok_trie().vocab_size() as u32
    }

    /// The bytes token `id` stands for (special tokens start with 0xFF).
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        self.env.tok_trie().token(id)
    }

    /// Whether `id` is a special token (`<|im_end|>` and friends).
    pub fn is_special(&self, id: u32) -> bool {
        self.env.tok_trie().is_special_token(id)
    }

    /// Text as the frontend's tokenizer encodes it (no special tokens added; the text of
    /// one is that token).
    pub fn encode(&self, text: &str) -> Vec<u32> {
        hf_encode(&self.tokenizer, text.as_bytes())
            .unwrap_or_else(|| self.env.tok_trie().greedy_tokenize(text.as_bytes()))
    }

    /// The text token `id` stands for, a special token's included.
    pub fn token_text(&self, id: u32) -> &[u8] {
        let b = self.token_bytes(id);
        b.strip_prefix(&[TokTrie::SPECIAL_TOKEN_MARKER])
            .unwrap_or(b)
    }

    /// Ids back to text, special tokens included (what a prompt looked like to the model).
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::new();
        for &id in ids {
            if id < self.size() {
                bytes.extend_from_slice(self.token_text(id));
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Whether the tag `needle` occurs in [`decode`](Self::decode)`(ids)`, without building
    /// the text. `needle` is ASCII, opens with `<` and holds no other (`<tools>`): ASCII
    /// bytes pass the lossy UTF-8 conversion unchanged, so it is in the text exactly when
    /// it is in the tokens' bytes, which one pass with no backtracking finds; outside a
    /// partial match only tokens holding a `<` can start one, and the rest are skipped.
    pub fn text_contains(&self, ids: &[u32], needle: &[u8]) -> bool {
        debug_assert!(needle.is_ascii() && needle[0] == b'<' && !needle[1..].contains(&b'<'));
        let trie = self.env.tok_trie();
        let mut matched = 0;
        for &id in ids {
            // out-of-vocabulary ids are skipped, as `decode` skips them
            let Some(&lt) = self.has_lt.get(id as usize) else {
                continue;
            };
            if matched == 0 && !lt {
                continue;
            }
            let b = trie.token(id);
            for &c in b
                .strip_prefix(&[TokTrie::SPECIAL_TOKEN_MARKER])
                .unwrap_or(b)
            {
                if c == needle[matched] {
                    matched += 1;
                    if matched == needle.len() {
                        return true;
                    }
                } else {
                    matched = usize::from(c == needle[0]);
                }
            }
        }
        false
    }

    /// The factory whose grammars match special tokens as `specials` says.
    pub(crate) fn factory(&self, specials: Specials) -> &ParserFactory {
        match specials {
            Specials::Apart => &self.factory,
            Specials::AsText => &self.factory_as_text,
        }
    }
}

fn eos_of(dir: &Path, tok: &tokenizers::Tokenizer) -> Option<u32> {
    let read = |name: &str| -> Option<serde_json::Value> {
        serde_json::from_str(&std::fs::read_to_string(dir.join(name)).ok()?).ok()
    };
    if let Some(g) = read("generation_config.json") {
        match &g["eos_token_id"] {
            serde_json::Value::Number(n) => return n.as_u64().map(|n| n as u32),
            serde_json::Value::Array(a) => {
                if let Some(n) = a.first().and_then(|n| n.as_u64()) {
                    return Some(n as u32);
                }
            }
            _ => {}
        }
    }
    let c = read("tokenizer_config.json")?;
    let name = match &c["eos_token"] {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Object(o) => o.get("content")?.as_str()?.to_string(),
        _ => return None,
    };
    tok.token_to_id(&name)
}

/// `--tokenizer`: a model directory, or the `tokenizer.json` in one.
pub fn model_dir_of(path: &Path) -> PathBuf {
    if path.is_file() {
        path.parent().map(Path::to_path_buf).unwrap_or_default()
    } else {
        path.to_path_buf()
    }
}

/// The embedded model with `markers` added after its 259 tokens, as special tokens or
/// ordinary ones: a model of one's own whose markup markers are tokens.
#[cfg(test)]
pub(crate) fn embedded_with_markers(markers: &[&str], special: bool) -> Arc<Vocabulary> {
    let mut t: serde_json::Value =
        serde_json::from_str(&vcr_host::tiny_model::tokenizer_json_text())
            .expect("the embedded tokenizer is JSON");
    let first = vcr_host::tiny_model::TOKENIZER_VOCAB as usize;
    if let Some(added) = t["added_tokens"].as_array_mut() {
        for (i, m) in markers.iter().enumerate() {
            added.push(
                serde_json::json!({"id": first + i, "content": m, "single_word": false,
                "lstrip": false, "rstrip": false, "normalized": false, "special": special}),
            );
        }
    }
    let eos = vcr_host::tiny_model::EOS_TOKEN_ID;
    Arc::new(Vocabulary::from_json(&t.to_string(), eos, "markers").expect("it loads"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_embedded_vocabulary_round_trips_text() {
        let v = Vocabulary::embedded();
        assert_eq!(v.size(), vcr_host::tiny_model::TOKENIZER_VOCAB);
        assert_eq!(v.eos, vcr_host::tiny_model::EOS_TOKEN_ID);
        let text = "Héllo, 東京 {\"a\": 1}";
        let ids = v.encode(text);
        assert_eq!(ids, vcr_host::tiny_model::encode_text(text));
        assert_eq!(v.decode(&ids), text);
        assert!(v.is_special(vcr_host::tiny_model::EOS_TOKEN_ID));
        assert_eq!(v.decode(&[1]), "<|im_start|>");
    }

    /// `serve --tiny-vocab chars`: what random-id prompt generators do (decode random ids,
    /// encode the text again) gives back the same ids, with the frontend's tokenizer
    /// (Hugging Face `tokenizers`) and in the engine's view of the tokens.
    #[test]
    fn the_chars_vocabulary_round_trips_any_id_sequence() {
        use vcr_host::tiny_model::{CHARS_UNK_TOKEN_ID, TinyVocab};
        let json = TinyVocab::Chars.tokenizer_json_text();
        let hf = tokenizers::Tokenizer::from_str(&json).unwrap();
        let v = Vocabulary::from_json(&json, vcr_host::tiny_model::EOS_TOKEN_ID, "chars").unwrap();
        assert_eq!(v.size(), vcr_host::tiny_model::TOKENIZER_VOCAB);
        let mut state = 0x2545_f491_4f6c_dd1du64;
        for n in 0..400 {
            let ids: Vec<u32> = (0..1 + n % 97)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    3 + (state % u64::from(CHARS_UNK_TOKEN_ID - 3)) as u32
                })
                .collect();
            let text = hf.decode(&ids, true).unwrap();
            assert_eq!(
                hf.encode(text.as_str(), false).unwrap().get_ids(),
                ids,
                "{text:?}"
            );
            assert_eq!(v.encode(&text), ids, "{text:?}");
            assert_eq!(v.decode(&ids), text);
        }
        // ordinary and non-ASCII text: one id per character, <unk> past the vocabulary
        let ids = v.encode("Grüße, 東京 {\"a\": 1}");
        assert_eq!(ids.len(), "Grüße, 東京 {\"a\": 1}".chars().count());
        assert_eq!(ids[7..9], [CHARS_UNK_TOKEN_ID; 2]);
        assert_eq!(v.token_bytes(ids[2]), "ü".as_bytes());
        assert_eq!(ids[0], 3 + u32::from(b'G'));
    }

    #[test]
    fn text_contains_finds_what_decode_would_show() {
        let v = Vocabulary::embedded();
        for text in [
            "<tools>",
            "a <<tools> b",
            "<tool<tools>",
            "<tool_call> 東京 <tools>\n{}\n</tools>",
            "<tool s>",
            "<tools",
            "",
            "é<tools>é",
        ] {
            let ids = v.encode(text);
            assert_eq!(
                v.text_contains(&ids, b"<tools>"),
                v.decode(&ids).contains("<tools>"),
                "{text:?}"
            );
        }
        // out-of-vocabulary ids are skipped by both
        assert!(v.text_contains(&[u32::MAX, 3 + 60, u32::MAX], b"<"));
    }

    /// A special token is one id in what the engine writes, and in the grammar's view
    /// that matches it by text; where no text matches it, the grammar backend is handed
    /// its text in ordinary tokens, and the end-of-sequence token is never text.
    #[test]
    fn a_special_token_is_text_only_where_the_grammar_matches_it_so() {
        let v = embedded_with_markers(&["<|channel|>"], true);
        let channel = vcr_host::tiny_model::TOKENIZER_VOCAB;
        assert!(v.is_special(channel));
        assert_eq!(v.encode("<|channel|>a"), [channel, 3 + u32::from(b'a')]);
        assert_eq!(v.token_text(channel), b"<|channel|>");
        let spelled = vcr_host::tiny_model::encode_text("<|channel|>a");
        let eos = vcr_host::tiny_model::EOS_TOKEN_ID;
        let as_text = v.factory(Specials::AsText).tok_env();
        assert_eq!(as_text.tokenize_bytes(b"<|channel|>a"), [channel, 3 + 97]);
        assert_eq!(as_text.tok_trie().token(channel), b"<|channel|>");
        assert!(as_text.tok_trie().is_special_token(eos));
        let im_end = vcr_host::tiny_model::encode_text("<|im_end|>");
        assert_eq!(as_text.tokenize_bytes(b"<|im_end|>"), im_end);
        let apart = v.factory(Specials::Apart).tok_env();
        assert_eq!(apart.tokenize_bytes(b"<|channel|>a"), spelled);
        assert!(apart.tok_trie().is_special_token(channel));
    }

    #[test]
    fn a_model_directory_loads_with_its_eos() {
        let dir = std::env::temp_dir().join(format!("vcr-vocab-{}", std::process::id()));
        vcr_host::tiny_model::write_to(&dir).unwrap();
        let v = Vocabulary::load(&dir).unwrap();
        assert_eq!(v.eos, vcr_host::tiny_model::EOS_TOKEN_ID);
        assert_eq!(v.encode("ab"), vec![3 + 97, 3 + 98]);
        let e = Vocabulary::load(&dir.join("nope")).unwrap_err().to_string();
        assert!(e.contains("cannot read"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }
}
