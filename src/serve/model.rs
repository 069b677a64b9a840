//! The model `serve` serves, and how a client finds its tokenizer: the user's directory
//! (`--model DIR`), or the embedded tiny model written into the cache and registered in the
//! Hugging Face hub cache as `vllm-vcr/tiny`, so that load generators which take a
//! tokenizer by repo id (most of them default to the model name) load it offline.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::ValueEnum;
use vcr_host::hf_cache;
use vcr_host::tiny_model::{self, TinyVocab};

use super::frontend::{vocab_size_of, write_embedded_model_of};
use crate::play::PlayArgs;

/// `serve --tiny-vocab`: the embedded model's vocabulary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum TinyVocabArg {
    /// One token per byte of UTF-8 (259 ids); registered as `vllm-vcr/tiny`.
    #[default]
    Bytes,
    /// One token per character (ASCII keeps its ids, 127 more characters, `<unk>` for the
    /// rest): any sequence of ids decodes to text that encodes back to it, which random-id
    /// prompt generators need; registered as `vllm-vcr/tiny-chars`.
    Chars,
}

impl From<TinyVocabArg> for TinyVocab {
    fn from(a: TinyVocabArg) -> TinyVocab {
        match a {
            TinyVocabArg::Bytes => TinyVocab::Bytes,
            TinyVocabArg::Chars => TinyVocab::Chars,
        }
    }
}

/// The model the frontend serves.
#[derive(Debug, Clone)]
pub(crate) struct ServedModel {
    /// The model directory the frontend loads (and the engine reads the tokenizer of).
    pub dir: PathBuf,
    /// The public name, the one answers carry.
    pub name: String,
    /// More names the frontend accepts for it: `vllm-vcr/tiny` for the embedded model once
    /// it is in the hub cache, so that a tool given `--model vllm-vcr/tiny` also finds the
    /// tokenizer by that name.
    pub aliases: Vec<String>,
    /// The repo id and the hub cache it is registered in (the embedded model, when the
    /// registration worked).
    pub hub: Option<(String, PathBuf)>,
}

/// What `serve`'s flags ask of the model: `--model`, `--tiny-vocab`,
/// `--served-model-name`.
pub(crate) struct ModelFlags<'a> {
    pub model: Option<&'a Path>,
    pub tiny_vocab: TinyVocabArg,
    pub served_model_name: Option<&'a str>,
}

/// The model `args` ask for; sets the engine's token ids to what its tokenizer has.
pub(crate) fn choose(args: &ModelFlags, play: &mut PlayArgs, cache: &Path) -> Result<ServedModel> {
    let (dir, name, hub) = match args.model {
        Some(dir) => {
            let dir = dir
                .canonicalize()
                .with_context(|| format!("model directory {}", dir.display()))?;
            let vocab = vocab_size_of(&dir)?;
            if play.vocab_size == PlayArgs::defaults().vocab_size {
                play.vocab_size = vocab;
            } else if play.vocab_size > vocab {
                bail!(
                    "--vocab-size {} is larger than the {vocab} ids of {}/tokenizer.json: the frontend cannot decode ids past {}",
                    play.vocab_size,
                    dir.display(),
                    vocab - 1
                );
            }
            let name = dir
                .file_name()
                .map(|n| n.to_string_lossy().to_string())
                .unwrap_or_else(|| "model".into());
            (dir, name, None)
        }
        None => {
            // the model's context is the engine's: --max-model-len reaches the frontend
            let vocab = TinyVocab::from(args.tiny_vocab);
            let dir = write_embedded_model_of(cache, vocab, play.max_model_len)?;
            let defaults = PlayArgs::defaults();
            if play.vocab_size == defaults.vocab_size && play.min_token_id == defaults.min_token_id
            {
                // printable ASCII: readable random text from the byte-level tokenizer
                play.min_token_id = tiny_model::byte_token_id(b' ');
                play.vocab_size = tiny_model::byte_token_id(b'~') + 1;
            }
            if play.vocab_size > tiny_model::TOKENIZER_VOCAB {
                bail!(
                    "--vocab-size {} is larger than the embedded model's {} token ids (pass --model DIR to serve a bigger vocabulary)",
                    play.vocab_size,
                    tiny_model::TOKENIZER_VOCAB
                );
            }
            let hub = register_embedded(&dir, vocab, play.max_model_len);
            (dir, "tiny".to_string(), hub)
        }
    };
    let name = args.served_model_name.map_or(name, str::to_string);
    let aliases = hub
        .iter()
        .map(|(id, _)| id.clone())
        .filter(|id| *id != name)
        .collect();
    Ok(ServedModel {
        dir,
        name,
        aliases,
        hub,
    })
}

/// Register the embedded model (as written for a context of `max_model_len`) in the hub
/// cache. A failure is a warning, never a reason not to serve: the directory still works
/// as `--tokenizer DIR`.
fn register_embedded(
    dir: &Path,
    vocab: TinyVocab,
    max_model_len: u64,
) -> Option<(String, PathBuf)> {
    let id = vocab.repo_id();
    let Some(hub) = hf_cache::hub_cache_dir() else {
        tracing::warn!(
            "no Hugging Face cache directory (HF_HUB_CACHE, HF_HOME and HOME give no absolute \
             path): {id} is not registered; tools take the tokenizer as --tokenizer {}",
            dir.display()
        );
        return None;
    };
    match hf_cache::register(&hub, id, &tiny_model::files_of(vocab, max_model_len)) {
        Ok(r) => match r.foreign_main {
            None => {
                tracing::debug!("{id} is revision {} in {}", r.revision, hub.display());
                Some((id.to_string(), hub))
            }
            Some(theirs) => {
                tracing::warn!(
                    "{} already holds another {id} (revision {theirs}), not written by \
                     vllm-vcr: it is left as it is, so tools loading {id} get that one. This \
                     model's tokenizer is revision {} beside it, or --tokenizer {}",
                    hf_cache::repo_dir(&hub, id).display(),
                    r.revision,
                    dir.display()
                );
                None
            }
        },
        Err(e) => {
            tracing::warn!(
                "cannot register {id} in the Hugging Face cache {} ({e}); tools take the \
                 tokenizer as --tokenizer {}",
                hub.display(),
                dir.display()
            );
            None
        }
    }
}

/// What `serve` prints once the frontend answers: where to connect, the model's names,
/// and how a load generator loads its tokenizer.
pub(crate) fn banner(base: &str, m: &ServedModel, frontend: &str, log: &Path) -> String {
    let name = &m.name;
    let mut s = format!(
        "vllm-vcr serve: a real vLLM frontend with a simulated engine is ready\n\
         \n  OpenAI base URL  {base}\n  model            {name}"
    );
    if !m.aliases.is_empty() {
        s.push_str(&format!(" (also served as {})", m.aliases.join(", ")));
    }
    let dir = m.dir.display();
    let tokenizer_flag = match &m.hub {
        Some((id, hub)) => {
            s.push_str(&format!(
                "\n  tokenizer        {id} (Hugging Face cache {}; loads offline)",
                hub.display()
            ));
            id.clone()
        }
        None => {
            s.push_str(&format!("\n  tokenizer        {dir}"));
            dir.to_string()
        }
    };
    s.push_str(&format!(
        "\n  model directory  {dir}\n  frontend         {frontend}\n  frontend log     {}\n\
         \n  curl {base}/chat/completions -H 'Content-Type: application/json' \\\n    \
         -d '{{\"model\":\"{name}\",\"messages\":[{{\"role\":\"user\",\"content\":\"Hello\"}}],\"max_tokens\":16}}'\n",
        log.display()
    ));
    s.push_str(&format!(
        "  load generators (vllm bench serve, guidellm, aiperf, inference-perf): \
         --model {name} --tokenizer {tokenizer_flag}\n\nCtrl-C to stop."
    ));
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn served(hub: bool) -> ServedModel {
        ServedModel {
            dir: "/c/model/tiny-0.1.0".into(),
            name: "tiny".into(),
            aliases: if hub {
                vec!["vllm-vcr/tiny".into()]
            } else {
                vec![]
            },
            hub: hub.then(|| ("vllm-vcr/tiny".into(), "/h/hub".into())),
        }
    }

    #[test]
    fn the_banner_names_the_tokenizer_and_the_directory() {
        let b = banner(
            "http://127.0.0.1:8000/v1",
            &served(true),
            "vllm-rs (vLLM 0.33, pid 7)",
            Path::new("/l.log"),
        );
        assert!(
            b.contains("model            tiny (also served as vllm-vcr/tiny)\n"),
            "{b}"
        );
        assert!(
            b.contains("tokenizer        vllm-vcr/tiny (Hugging Face cache /h/hub"),
            "{b}"
        );
        assert!(b.contains("model directory  /c/model/tiny-0.1.0\n"), "{b}");
        assert!(b.contains("--model tiny --tokenizer vllm-vcr/tiny"), "{b}");
        assert!(
            b.contains("\n  frontend         vllm-rs (vLLM 0.33, pid 7)\n"),
            "{b}"
        );

        // not registered: the directory is the tokenizer
        let b = banner("http://h/v1", &served(false), "f", Path::new("/l.log"));
        assert!(b.contains("model            tiny\n"), "{b}");
        assert!(b.contains("tokenizer        /c/model/tiny-0.1.0\n"), "{b}");
        assert!(
            b.contains("--model tiny --tokenizer /c/model/tiny-0.1.0"),
            "{b}"
        );
    }
}
