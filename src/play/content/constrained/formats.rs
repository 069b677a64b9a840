//! The tool-call formats of the frontends' tool parsers (`--tool-call-format`): how an
//! answer that calls a tool is written, so that the parser the frontend was started with
//! (`--tool-call-parser`) turns it into `tool_calls` and leaves `content` empty.
//!
//! Each format is a Lark grammar around the tool's name and arguments; the arguments follow
//! the tool's (closed) JSON schema, as a JSON object or, for the formats that spell each
//! argument on its own (pythonic, Qwen3's XML, GLM's key/value tags, …), one value per
//! property. The parsers of a few formats look their markers up as single tokens of the
//! vocabulary (llama3_json's `<|python_tag|>`, mistral's `[TOOL_CALLS]`, deepseek_v3's
//! `<｜tool▁calls▁begin｜>`, …: [`ToolCallFormat::needs_tokens`]) and refuse to start with a
//! byte-level tokenizer such as the embedded model's: they serve a model of your own.
//! Harmony (`openai`) is read from the token ids of gpt-oss's own vocabulary: only a model
//! with gpt-oss's tokenizer is read.

use serde_json::Value;

use super::lark::{lark_lit, lark_seq, lark_str, schema_text};
use super::nested::{gemma4_fields, minimax_m3_fields};
use super::spelled::{Style, spelled};

/// How a tool call is written: the name is the frontend's `--tool-call-parser` that reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum ToolCallFormat {
    /// `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>` (Hermes, Qwen2.5/3 JSON).
    #[default]
    #[value(name = "hermes")]
    Hermes,
    /// `[get_weather(city="Paris", days=3)]`, Python call syntax (Llama 3.2, many others).
    #[value(name = "pythonic")]
    Pythonic,
    /// Llama 4's pythonic calls (the same text; its parser also takes `<|python_start|>`).
    #[value(name = "llama4_pythonic")]
    Llama4Pythonic,
    /// Qwen3-Coder's XML: `<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>…`.
    #[value(name = "qwen3_xml")]
    Qwen3Xml,
    /// The same XML under its other parser name.
    #[value(name = "qwen3_coder")]
    Qwen3Coder,
    /// GLM-4.5/4.7: `<tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>…`.
    #[value(name = "glm45")]
    Glm45,
    /// Granite 3: `<|tool_call|>[{"name": …, "arguments": {…}}]`.
    #[value(name = "granite")]
    Granite,
    /// Kimi K2: `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0…`.
    #[value(name = "kimi_k2")]
    KimiK2,
    /// xLAM: a bare JSON list `[{"name": …, "arguments": {…}}]`.
    #[value(name = "xlam")]
    Xlam,
    /// InternLM 2: `<|action_start|><|plugin|>\n{"name": …, "parameters": {…}}<|action_end|>`.
    #[value(name = "internlm")]
    Internlm,
    /// Phi-4-mini: `functools[{"name": …, "arguments": {…}}]`.
    #[value(name = "phi4_mini_json")]
    Phi4MiniJson,
    /// Llama 3.1/3.2 JSON: `{"name": …, "parameters": {…}}` (its parser needs
    /// `<|python_tag|>` in the vocabulary: a model of your own, `serve --model DIR`).
    #[value(name = "llama3_json")]
    Llama3Json,
    /// Mistral (v11+ tokenizers): `[TOOL_CALLS]NAME[ARGS]{…}` (its parser needs
    /// `[TOOL_CALLS]` in the vocabulary).
    #[value(name = "mistral")]
    Mistral,
    /// DeepSeek-V3: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json…`
    /// (its parser needs those markers in the vocabulary).
    #[value(name = "deepseek_v3")]
    DeepseekV3,
    /// DeepSeek-V3.1: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{…}<｜tool▁call▁end｜>…`
    /// (its parser needs the calls' markers in the vocabulary).
    #[value(name = "deepseek_v31")]
    DeepseekV31,
    /// MiniMax-M2: `<minimax:tool_call>\n<invoke name="NAME">\n<parameter name="KEY">VALUE</parameter>…`.
    #[value(name = "minimax_m2")]
    MinimaxM2,
    /// Seed-OSS: Qwen3-Coder's XML inside `<seed:tool_call>…</seed:tool_call>`.
    #[value(name = "seed_oss")]
    SeedOss,
    /// MiMo: Qwen3-Coder's XML without line breaks,
    /// `<tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></tool_call>`
    /// (its parser keeps the line breaks around a value as part of it).
    #[value(name = "mimo")]
    Mimo,
    /// dots.llm: `<dots_function_call>\n<invoke name="NAME">\n<parameter name="KEY">VALUE</parameter>…`.
    #[value(name = "dots")]
    Dots,
    /// Step-3: `<｜tool_calls_begin｜><｜tool_call_begin｜>function<｜tool_sep｜><steptml:invoke name="NAME">…`.
    #[value(name = "step3")]
    Step3,
    /// LongCat-Flash: Hermes's JSON inside `<longcat_tool_call>…</longcat_tool_call>`.
    #[value(name = "longcat")]
    Longcat,
    /// Hunyuan-A13B: `<tool_calls>[{"name": …, "arguments": {…}}]</tool_calls>`.
    #[value(name = "hunyuan_a13b")]
    HunyuanA13b,
    /// Jamba: the same text as Hunyuan's (its parser needs `<tool_calls>` and
    /// `</tool_calls>` in the vocabulary).
    #[value(name = "jamba")]
    Jamba,
    /// Granite 20B FC: `<function_call> {"name": …, "arguments": {…}}`.
    #[value(name = "granite-20b-fc")]
    Granite20bFc,
    /// GigaChat 3: `<|function_call|>{"name": …, "arguments": {…}}`.
    #[value(name = "gigachat3")]
    Gigachat3,
    /// Apertus: `<|tools_prefix|>[{"NAME": {…}}]<|tools_suffix|>`.
    #[value(name = "apertus")]
    Apertus,
    /// OLMo 3: `<function_calls>NAME(city="Paris", days=3)</function_calls>`.
    #[value(name = "olmo3")]
    Olmo3,
    /// LFM2: `<|tool_call_start|>[NAME(city="Paris", days=3)]<|tool_call_end|>` (its parser
    /// needs those two markers in the vocabulary).
    #[value(name = "lfm2")]
    Lfm2,
    /// FunctionGemma: `<start_function_call>call:NAME{KEY:<escape>VALUE<escape>,…}<end_function_call>`.
    #[value(name = "functiongemma")]
    FunctionGemma,
    /// DeepSeek-V3.2's DSML: `<｜DSML｜function_calls>\n<｜DSML｜invoke name="NAME">\n`
    /// `<｜DSML｜parameter name="KEY" string="true">VALUE</｜DSML｜parameter>\n…`.
    #[value(name = "deepseek_v32")]
    DeepseekV32,
    /// DeepSeek-V4's DSML: the same inside `<｜DSML｜tool_calls>…</｜DSML｜tool_calls>`.
    #[value(name = "deepseek_v4")]
    DeepseekV4,
    /// DeepSeek-V4.1's spaced DSML: `<｜DSML｜ calls>\n<｜DSML｜ invoke name="NAME">\n`
    /// `<｜DSML｜ parameter name="KEY" string="true">VALUE</｜DSML｜ parameter>\n…`.
    #[value(name = "deepseek_v41")]
    DeepseekV41,
    /// MiniMax-M3: every tag after `]<]minimax[>[`, arguments as elements named after them
    /// (`<city>Paris</city>`), nested: an object's fields as elements, a list's items as
    /// `<item>` elements.
    #[value(name = "minimax_m3")]
    MinimaxM3,
    /// PLaMo 3: `<|plamo:begin_tool_requests:plamo|><|plamo:begin_tool_request:plamo|>`
    /// `<|plamo:begin_tool_name:plamo|>NAME<|plamo:end_tool_name:plamo|>`, then the JSON
    /// arguments in `<|plamo:begin_tool_arguments:plamo|><|plamo:constrain|>json<|plamo:msg|>`
    /// … `<|plamo:end_tool_arguments:plamo|>`, and the two ends.
    #[value(name = "plamo3")]
    Plamo3,
    /// Inkling: `<|message_model|><|content_invoke_tool_json|>{"name": …, "args": {…}}`
    /// `<|end_message|>`.
    #[value(name = "inkling")]
    Inkling,
    /// Muse Spark: ` to=NAME<|message|><atem:function_calls>\n`
    /// `<atem:invoke name="NAME">\n<atem:parameter name="KEY">VALUE</atem:parameter>\n…`
    /// `</atem:invoke>\n</atem:function_calls><|eom|>`, strings bare (its parser keeps a
    /// string parameter as written and reads the others as JSON). The prompt ends with
    /// `<|start|>assistant`, so the answer's first message opens with its recipient.
    #[value(name = "muse")]
    Muse,
    /// Muse Glimmer: the same with every value as JSON (its parser reads each as JSON
    /// first, so a bare `true` would not stay a string).
    #[value(name = "muse_glimmer")]
    MuseGlimmer,
    /// Gemma 4: `<|tool_call>call:NAME{city:<|"|>Paris<|"|>,days:3}<tool_call|>`, its own
    /// syntax: strings between `<|"|>`, other scalars bare, objects and lists nested in it.
    #[value(name = "gemma4")]
    Gemma4,
    /// Command A (Cohere's `cmd3` rendering): `<|START_ACTION|>[\n    {"tool_call_id": "0",`
    /// ` "tool_name": …, "parameters": {…}}\n]<|END_ACTION|>`, as the model writes its calls.
    #[value(name = "cohere_command3")]
    CohereCommand3,
    /// Command A Reasoning (`cmd4`): the same calls, read by its own parser.
    #[value(name = "cohere_command4")]
    CohereCommand4,
    /// Hunyuan V3: `<tool_calls>\n<tool_call>NAME<tool_sep>\n<arg_key>KEY</arg_key>\n`
    /// `<arg_value>VALUE</arg_value>\n…</tool_call>\n</tool_calls>`, strings bare (its
    /// parser types the values by the schema; it needs `<tool_calls>` and `</tool_calls>`
    /// in the vocabulary).
    #[value(name = "hy_v3")]
    HyV3,
    /// Hunyuan V4: the same inline, without `<tool_sep>` after the name.
    #[value(name = "hy_v4")]
    HyV4,
    /// Kimi K3's XTML tools channel: `<|open|>tools<|sep|><|open|>call tool="NAME" index="1"`
    /// `<|sep|><|open|>argument key="KEY" type="TYPE"<|sep|>VALUE<|close|>argument<|sep|>…`
    /// `<|close|>call<|sep|><|close|>tools<|sep|>`: a string bare under `type="string"`, any
    /// other value as JSON under its JSON type (`number` for integers, as Kimi K3 writes it).
    #[value(name = "kimi_k3")]
    KimiK3,
    /// K2 Horizon's IFM XML (its default `tool_call_format`): `<ifm|tool_calls><ifm|tool_call>`
    /// `NAME<ifm|arg_key>KEY</ifm|arg_key><ifm|arg_value>VALUE</ifm|arg_value>…`
    /// `</ifm|tool_call></ifm|tool_calls>`, strings bare.
    #[value(name = "k2_horizon")]
    K2Horizon,
    /// MiniCPM5's XML: `<function name="NAME"><param name="KEY">VALUE</param>…</function>`,
    /// strings bare (its parser reads the block as XML and types values by the schema).
    #[value(name = "minicpm5")]
    Minicpm5,
    /// gpt-oss's harmony: `<|channel|>commentary to=functions.NAME <|constrain|>json`
    /// `<|message|>{…}<|call|>` (the prompt ends with `<|start|>assistant`). The frontend
    /// reads harmony as token ids of gpt-oss's own vocabulary (o200k_harmony), so only a
    /// model with that tokenizer is read.
    #[value(name = "openai")]
    Openai,
    /// The frontends' `hf` parser: the model's own `response_template` (its
    /// `tokenizer_config.json`) says how an answer reads. The engine writes Hermes's text,
    /// which the embedded model's template describes (the function named in the opener).
    #[value(name = "hf")]
    Hf,
    /// Beam's parser: the same template-driven reading as `hf`, and for `required` a grammar
    /// derived from the template: the engine writes the same text. vllm-rs's constrains
    /// answers to Beam's own markup, which the engine writes where a tag asks for it.
    #[value(name = "beam")]
    Beam,
}

/// Parser names that read a format under another name.
const ALIASES: &[(&str, ToolCallFormat)] = &[
    ("qwen3_json", ToolCallFormat::Hermes),
    ("granite4", ToolCallFormat::Hermes),
    ("glm47", ToolCallFormat::Glm45),
    ("llama4_json", ToolCallFormat::Llama3Json),
    // ERNIE 4.5 reads Hermes's text; Step-3.5 and Step-5 read Qwen3-Coder's XML
    ("ernie45", ToolCallFormat::Hermes),
    ("step3p5", ToolCallFormat::Qwen3Coder),
    ("step5", ToolCallFormat::Qwen3Coder),
    // Ling 3 reads GLM-4.7's text
    ("ling3", ToolCallFormat::Glm45),
    // Poolside's (Laguna's) parser reads GLM-4.5's text
    ("poolside_v1", ToolCallFormat::Glm45),
    ("musespark1x", ToolCallFormat::Muse),
];

impl ToolCallFormat {
    /// The `--tool-call-parser` that reads this format (the same name on both frontends).
    pub fn parser(self) -> &'static str {
        match self {
            ToolCallFormat::Hermes => "hermes",
            ToolCallFormat::Pythonic => "pythonic",
            ToolCallFormat::Llama4Pythonic => "llama4_pythonic",
            ToolCallFormat::Qwen3Xml => "qwen3_xml",
            ToolCallFormat::Qwen3Coder => "qwen3_coder",
            ToolCallFormat::Glm45 => "glm45",
            ToolCallFormat::Granite => "granite",
            ToolCallFormat::KimiK2 => "kimi_k2",
            ToolCallFormat::Xlam => "xlam",
            ToolCallFormat::Internlm => "internlm",
            ToolCallFormat::Phi4MiniJson => "phi4_mini_json",
            ToolCallFormat::Llama3Json => "llama3_json",
            ToolCallFormat::Mistral => "mistral",
            ToolCallFormat::DeepseekV3 => "deepseek_v3",
            ToolCallFormat::DeepseekV31 => "deepseek_v31",
            ToolCallFormat::MinimaxM2 => "minimax_m2",
            ToolCallFormat::SeedOss => "seed_oss",
            ToolCallFormat::Mimo => "mimo",
            ToolCallFormat::Dots => "dots",
            ToolCallFormat::Step3 => "step3",
            ToolCallFormat::Longcat => "longcat",
            ToolCallFormat::HunyuanA13b => "hunyuan_a13b",
            ToolCallFormat::Jamba => "jamba",
            ToolCallFormat::Granite20bFc => "granite-20b-fc",
            ToolCallFormat::Gigachat3 => "gigachat3",
            ToolCallFormat::Apertus => "apertus",
            ToolCallFormat::Olmo3 => "olmo3",
            ToolCallFormat::Lfm2 => "lfm2",
            ToolCallFormat::FunctionGemma => "functiongemma",
            ToolCallFormat::DeepseekV32 => "deepseek_v32",
            ToolCallFormat::DeepseekV4 => "deepseek_v4",
            ToolCallFormat::DeepseekV41 => "deepseek_v41",
            ToolCallFormat::Gemma4 => "gemma4",
            ToolCallFormat::MinimaxM3 => "minimax_m3",
            ToolCallFormat::Plamo3 => "plamo3",
            ToolCallFormat::Inkling => "inkling",
            ToolCallFormat::Muse => "muse",
            ToolCallFormat::MuseGlimmer => "muse_glimmer",
            ToolCallFormat::CohereCommand3 => "cohere_command3",
            ToolCallFormat::CohereCommand4 => "cohere_command4",
            ToolCallFormat::HyV3 => "hy_v3",
            ToolCallFormat::HyV4 => "hy_v4",
            ToolCallFormat::KimiK3 => "kimi_k3",
            ToolCallFormat::K2Horizon => "k2_horizon",
            ToolCallFormat::Minicpm5 => "minicpm5",
            ToolCallFormat::Openai => "openai",
            ToolCallFormat::Hf => "hf",
            ToolCallFormat::Beam => "beam",
        }
    }

    /// The markers this format's parser looks up as single tokens of the vocabulary (it
    /// refuses to start without them): none for most.
    pub fn needs_tokens(self) -> &'static [&'static str] {
        match self {
            ToolCallFormat::Llama3Json => &["<|python_tag|>"],
            ToolCallFormat::Mistral => &["[TOOL_CALLS]"],
            ToolCallFormat::DeepseekV3 | ToolCallFormat::DeepseekV31 => {
                &["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"]
            }
            ToolCallFormat::Jamba | ToolCallFormat::HyV3 | ToolCallFormat::HyV4 => {
                &["<tool_calls>", "</tool_calls>"]
            }
            ToolCallFormat::Lfm2 => &["<|tool_call_start|>", "<|tool_call_end|>"],
            ToolCallFormat::Openai => &["<|channel|>", "<|constrain|>", "<|message|>", "<|call|>"],
            _ => &[],
        }
    }

    /// The format a `--tool-call-parser` reads, when the engine can write it.
    pub fn from_parser(name: &str) -> Option<ToolCallFormat> {
        use clap::ValueEnum;
        ToolCallFormat::from_str(name, false)
            .ok()
            .or_else(|| ALIASES.iter().find(|(n, _)| *n == name).map(|(_, f)| *f))
    }

    /// Lark grammars of the other forms a call of this format takes, which a structural
    /// tag may ask for instead: for `beam`, Beam's own markup, what vllm-rs's `beam` parser
    /// constrains calls to (` to=NAME<|channel|>analysis <|constrain|>xml<|message|>`, each
    /// argument in `<rfl:parameter name="KEY">`, then `<|call|>`).
    pub fn other_forms(self, name: &str, params: &Value) -> Vec<String> {
        match self {
            ToolCallFormat::Beam => vec![spelled(
                &format!(" to={name}{BEAM_CALL}"),
                Style::Rfl,
                params,
                "<|call|>",
            )],
            _ => Vec::new(),
        }
    }

    /// Whether a structural tag (its text `tag`) offers, beside the calls, a text answer in
    /// this format's own markup: Beam's final channel, which vllm-rs's `beam` tag offers
    /// under `tool_choice: auto` ([`Self::text_answer`]).
    pub fn offers_text_answer(self, tag: &str) -> bool {
        self == ToolCallFormat::Beam && tag.contains(BEAM_FINAL)
    }

    /// A Lark grammar of the text answer `text` in this format's markup, for a tag that
    /// [offers one](Self::offers_text_answer): `<|channel|>final<|message|>…<|return|>`.
    pub fn text_answer(self, text: &str) -> String {
        format!(
            "start: {}\n",
            lark_str(&format!("{BEAM_FINAL}{text}<|return|>"))
        )
    }

    /// A Lark grammar of one call to `name` whose arguments follow `params` (a closed JSON
    /// schema).
    pub fn grammar(self, name: &str, params: &Value) -> String {
        let json_call = |key: &str| {
            format!(
                "{{\"name\": {}, \"{key}\": ",
                serde_json::to_string(name).unwrap_or_default()
            )
        };
        let args = format!("args: %json {}\n", schema_text(params));
        let wrap = |before: String, after: &str| {
            let start = lark_seq(&[&lark_str(&before), "args", &lark_lit(after)]);
            format!("start: {start}\n{args}")
        };
        match self {
            ToolCallFormat::Hermes | ToolCallFormat::Hf | ToolCallFormat::Beam => wrap(
                format!("<tool_call>\n{}", json_call("arguments")),
                "}\n</tool_call>",
            ),
            ToolCallFormat::Granite => {
                wrap(format!("<|tool_call|>[{}", json_call("arguments")), "}]")
            }
            ToolCallFormat::Xlam => wrap(format!("[{}", json_call("arguments")), "}]"),
            ToolCallFormat::Phi4MiniJson => {
                wrap(format!("functools[{}", json_call("arguments")), "}]")
            }
            ToolCallFormat::Internlm => wrap(
                format!("<|action_start|><|plugin|>\n{}", json_call("parameters")),
                "}<|action_end|>",
            ),
            ToolCallFormat::KimiK2 => wrap(
                format!(
                    "<|tool_calls_section_begin|><|tool_call_begin|>functions.{name}:0<|tool_call_argument_begin|>"
                ),
                "<|tool_call_end|><|tool_calls_section_end|>",
            ),
            ToolCallFormat::Llama3Json => wrap(json_call("parameters"), "}"),
            ToolCallFormat::Mistral => wrap(format!("[TOOL_CALLS]{name}[ARGS]"), ""),
            ToolCallFormat::DeepseekV3 => wrap(
                format!(
                    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n"
                ),
                "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
            ),
            ToolCallFormat::DeepseekV31 => wrap(
                format!("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{name}<｜tool▁sep｜>"),
                "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
            ),
            ToolCallFormat::Longcat => wrap(
                format!("<longcat_tool_call>\n{}", json_call("arguments")),
                "}\n</longcat_tool_call>",
            ),
            ToolCallFormat::HunyuanA13b | ToolCallFormat::Jamba => wrap(
                format!("<tool_calls>[{}", json_call("arguments")),
                "}]</tool_calls>",
            ),
            ToolCallFormat::Granite20bFc => {
                wrap(format!("<function_call> {}", json_call("arguments")), "}")
            }
            ToolCallFormat::Gigachat3 => {
                wrap(format!("<|function_call|>{}", json_call("arguments")), "}")
            }
            ToolCallFormat::Apertus => wrap(
                format!(
                    "<|tools_prefix|>[{{{}: ",
                    serde_json::to_string(name).unwrap_or_default()
                ),
                "}]<|tools_suffix|>",
            ),
            ToolCallFormat::Muse | ToolCallFormat::MuseGlimmer => spelled(
                &format!(
                    " to={name}<|message|><atem:function_calls>\n<atem:invoke name=\"{name}\">\n"
                ),
                if self == ToolCallFormat::Muse {
                    Style::Atem
                } else {
                    Style::AtemJson
                },
                params,
                "</atem:invoke>\n</atem:function_calls><|eom|>",
            ),
            ToolCallFormat::CohereCommand3 | ToolCallFormat::CohereCommand4 => wrap(
                format!(
                    "<|START_ACTION|>[\n    {{\"tool_call_id\": \"0\", \"tool_name\": {}, \"parameters\": ",
                    serde_json::to_string(name).unwrap_or_default()
                ),
                "}\n]<|END_ACTION|>",
            ),
            ToolCallFormat::Openai => wrap(
                format!("<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"),
                "<|call|>",
            ),
            ToolCallFormat::Inkling => wrap(
                format!(
                    "<|message_model|><|content_invoke_tool_json|>{}",
                    json_call("args")
                ),
                "}<|end_message|>",
            ),
            ToolCallFormat::Plamo3 => wrap(
                format!(
                    "<|plamo:begin_tool_requests:plamo|><|plamo:begin_tool_request:plamo|><|plamo:begin_tool_name:plamo|>{name}<|plamo:end_tool_name:plamo|><|plamo:begin_tool_arguments:plamo|><|plamo:constrain|>json<|plamo:msg|>"
                ),
                "<|plamo:end_tool_arguments:plamo|><|plamo:end_tool_request:plamo|><|plamo:end_tool_requests:plamo|>",
            ),
            ToolCallFormat::Pythonic | ToolCallFormat::Llama4Pythonic => {
                spelled(&format!("[{name}("), Style::Pythonic, params, ")]")
            }
            ToolCallFormat::Qwen3Xml | ToolCallFormat::Qwen3Coder => spelled(
                &format!("<tool_call>\n<function={name}>\n"),
                Style::QwenXml,
                params,
                "</function>\n</tool_call>",
            ),
            ToolCallFormat::Glm45 => spelled(
                &format!("<tool_call>{name}\n"),
                Style::GlmXml,
                params,
                "</tool_call>",
            ),
            ToolCallFormat::Olmo3 => spelled(
                &format!("<function_calls>{name}("),
                Style::Pythonic,
                params,
                ")</function_calls>",
            ),
            ToolCallFormat::Lfm2 => spelled(
                &format!("<|tool_call_start|>[{name}("),
                Style::Pythonic,
                params,
                ")]<|tool_call_end|>",
            ),
            ToolCallFormat::SeedOss => spelled(
                &format!("<seed:tool_call>\n<function={name}>\n"),
                Style::QwenXml,
                params,
                "</function>\n</seed:tool_call>",
            ),
            ToolCallFormat::Mimo => spelled(
                &format!("<tool_call><function={name}>"),
                Style::QwenInline,
                params,
                "</function></tool_call>",
            ),
            ToolCallFormat::MinimaxM2 => spelled(
                &format!("<minimax:tool_call>\n<invoke name=\"{name}\">\n"),
                Style::InvokeXml,
                params,
                "</invoke>\n</minimax:tool_call>",
            ),
            ToolCallFormat::Dots => spelled(
                &format!("<dots_function_call>\n<invoke name=\"{name}\">\n"),
                Style::InvokeXml,
                params,
                "</invoke>\n</dots_function_call>",
            ),
            ToolCallFormat::Step3 => spelled(
                &format!(
                    "<｜tool_calls_begin｜><｜tool_call_begin｜>function<｜tool_sep｜><steptml:invoke name=\"{name}\">"
                ),
                Style::StepXml,
                params,
                "</steptml:invoke><｜tool_call_end｜><｜tool_calls_end｜>",
            ),
            // Hunyuan V3 lays its calls out a line each, V4 inline (the layouts vllm-rs's
            // tags of `required` spell)
            ToolCallFormat::HyV3 => spelled(
                &format!("<tool_calls>\n<tool_call>{name}<tool_sep>\n"),
                Style::GlmXml,
                params,
                "</tool_call>\n</tool_calls>",
            ),
            ToolCallFormat::HyV4 => spelled(
                &format!("<tool_calls><tool_call>{name}"),
                Style::HyXml,
                params,
                "</tool_call></tool_calls>",
            ),
            ToolCallFormat::KimiK3 => spelled(
                &format!("<|open|>tools<|sep|><|open|>call tool=\"{name}\" index=\"1\"<|sep|>"),
                Style::Xtml,
                params,
                "<|close|>call<|sep|><|close|>tools<|sep|>",
            ),
            ToolCallFormat::K2Horizon => spelled(
                &format!("<ifm|tool_calls><ifm|tool_call>{name}"),
                Style::IfmXml,
                params,
                "</ifm|tool_call></ifm|tool_calls>",
            ),
            ToolCallFormat::Minicpm5 => spelled(
                &format!("<function name=\"{name}\">"),
                Style::ParamXml,
                params,
                "</function>",
            ),
            ToolCallFormat::FunctionGemma => spelled(
                &format!("<start_function_call>call:{name}{{"),
                Style::Gemma,
                params,
                "}<end_function_call>",
            ),
            ToolCallFormat::DeepseekV32 | ToolCallFormat::DeepseekV4 => {
                let block = if self == ToolCallFormat::DeepseekV32 {
                    "function_calls"
                } else {
                    "tool_calls"
                };
                spelled(
                    &format!("<｜DSML｜{block}>\n<｜DSML｜invoke name=\"{name}\">\n"),
                    Style::Dsml,
                    params,
                    &format!("</｜DSML｜invoke>\n</｜DSML｜{block}>"),
                )
            }
            ToolCallFormat::DeepseekV41 => spelled(
                &format!("<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"{name}\">\n"),
                Style::DsmlSpaced,
                params,
                "</｜DSML｜ invoke>\n</｜DSML｜ calls>",
            ),
            ToolCallFormat::Gemma4 => {
                let mut rules = Vec::new();
                let args = gemma4_fields(params, &mut rules, 0);
                nested_call(
                    &format!("<|tool_call>call:{name}{{"),
                    &args,
                    "}<tool_call|>",
                    rules,
                )
            }
            ToolCallFormat::MinimaxM3 => {
                let mut rules = Vec::new();
                let args = minimax_m3_fields(params, &mut rules, 0, "\n");
                nested_call(
                    &format!("{M3}<tool_call>\n{M3}<invoke name=\"{name}\">\n"),
                    &args,
                    &format!("{M3}</invoke>\n{M3}</tool_call>"),
                    rules,
                )
            }
        }
    }
}

/// MiniMax-M3's marker before every tag of its calls.
const M3: &str = "]<]minimax[>[";

/// The markers Beam's markup is spelled with (vllm-rs's `beam` parser constrains answers to
/// it), in the order a model of one's own adds them to the embedded vocabulary in the
/// tests: a model whose tokenizer has them as tokens can stand behind that parser.
pub const BEAM_MARKERS: &[&str] = &[
    "<|channel|>",
    "<|message|>",
    "<|return|>",
    "<|constrain|>",
    "<|end|>",
    "<|start|>",
    "<|call|>",
];

/// What follows a call's function name in Beam's markup.
const BEAM_CALL: &str = "<|channel|>analysis <|constrain|>xml<|message|>";
/// What opens a text answer in Beam's markup.
const BEAM_FINAL: &str = "<|channel|>final<|message|>";

/// A call of the nested formats: `args` (a Lark expression whose sub-rules are `rules`)
/// between `begin` and `end`.
fn nested_call(begin: &str, args: &str, end: &str, rules: Vec<String>) -> String {
    let start = lark_seq(&[&lark_str(begin), args, &lark_str(end)]);
    let mut lark = format!("start: {start}\n");
    for r in rules {
        lark.push_str(&r);
        lark.push('\n');
    }
    lark
}
