//! Tool calls in every `--tool-call-format`: each format's answer read back as its
//! frontend parser reads it (the tool, and arguments typed by the tool's schema), and the
//! argument styles of the structural tags the frontends send for `required`.

use super::*;

/// A Python call `NAME(k=v, …` (the closing parenthesis cut): the name and its arguments,
/// each value JSON (the formats write Python's literals as JSON's).
fn python_call(body: &str) -> Option<(String, Value)> {
    let (name, mut rest) = body.split_once('(')?;
    let mut args = serde_json::Map::new();
    while !rest.is_empty() {
        let (k, after) = rest.trim_start_matches(", ").split_once('=')?;
        let mut de = serde_json::Deserializer::from_str(after).into_iter::<Value>();
        args.insert(k.into(), de.next()?.ok()?);
        rest = &after[de.byte_offset()..];
    }
    Some((name.into(), Value::Object(args)))
}

/// Gemma 4's arguments (`key:value,…` with strings between `<|"|>`, objects `{…}`, lists
/// `[…]`) as JSON, scalars typed as the frontend types them (bare text read as JSON);
/// `None` where the text is not that syntax. The rest of the text is returned too.
fn gemma4_value(t: &str) -> Option<(Value, &str)> {
    const Q: &str = "<|\"|>";
    if let Some(rest) = t.strip_prefix(Q) {
        let (s, rest) = rest.split_once(Q)?;
        return Some((Value::String(s.into()), rest));
    }
    if let Some(mut rest) = t.strip_prefix('{') {
        let mut obj = serde_json::Map::new();
        loop {
            if let Some(after) = rest.strip_prefix('}') {
                return Some((Value::Object(obj), after));
            }
            rest = rest.strip_prefix(',').unwrap_or(rest);
            let (k, after) = rest.split_once(':')?;
            let (v, after) = gemma4_value(after)?;
            obj.insert(k.into(), v);
            rest = after;
        }
    }
    if let Some(mut rest) = t.strip_prefix('[') {
        let mut items = Vec::new();
        loop {
            if let Some(after) = rest.strip_prefix(']') {
                return Some((Value::Array(items), after));
            }
            rest = rest.strip_prefix(',').unwrap_or(rest);
            let (v, after) = gemma4_value(rest)?;
            items.push(v);
            rest = after;
        }
    }
    let end = t.find([',', '}', ']'])?;
    Some((serde_json::from_str(&t[..end]).ok()?, &t[end..]))
}

/// MiniMax-M3's elements (`]<]minimax[>[<k>…]<]minimax[>[</k>`, whitespace between them)
/// as JSON: an element of `<item>` children a list, of other children an object, else its
/// text (read as JSON where it is, as the frontend types it by the schema).
fn m3_elements(mut t: &str) -> Option<Value> {
    const M3: &str = "]<]minimax[>[";
    let mut fields = Vec::new();
    loop {
        t = t.trim_start();
        if t.is_empty() {
            break;
        }
        let (name, rest) = t.strip_prefix(M3)?.strip_prefix('<')?.split_once('>')?;
        let close = format!("{M3}</{name}>");
        // the matching close: the first one after as many opens of the same name
        let (mut depth, mut at) = (0, 0);
        let end = loop {
            let next_close = rest[at..].find(&close)? + at;
            let opens = rest[at..next_close]
                .matches(&format!("{M3}<{name}>"))
                .count();
            depth += opens;
            if depth == 0 {
                break next_close;
            }
            depth -= 1;
            at = next_close + close.len();
        };
        let body = &rest[..end];
        let value = if body.starts_with(M3) {
            m3_elements(body)?
        } else {
            serde_json::from_str(body).unwrap_or_else(|_| Value::String(body.into()))
        };
        fields.push((name.to_string(), value));
        t = &rest[end + close.len()..];
    }
    if !fields.is_empty() && fields.iter().all(|(k, _)| k == "item") {
        return Some(Value::Array(fields.into_iter().map(|(_, v)| v).collect()));
    }
    Some(Value::Object(fields.into_iter().collect()))
}

/// A call as each format's parser reads it: the tool's name and its arguments.
fn read_call(format: ToolCallFormat, t: &str) -> Option<(String, Value)> {
    let json_call = |prefix: &str, key: &str, suffix: &str| {
        let body = t.strip_prefix(prefix)?.strip_suffix(suffix)?;
        let v: Value = serde_json::from_str(body).ok()?;
        Some((v["name"].as_str()?.to_string(), v[key].clone()))
    };
    // a run of `KEY<sep>VALUE<end>` pairs, values as JSON or (`raw`) bare strings
    let pairs = |body: &str, open: &str, sep: &str, end: &str| -> Option<Value> {
        let mut args = serde_json::Map::new();
        for part in body.split(open).skip(1) {
            let (k, rest) = part.split_once(sep)?;
            let v = rest.split(end).next()?.trim_matches('\n');
            let v = serde_json::from_str(v).unwrap_or_else(|_| Value::String(v.into()));
            args.insert(k.to_string(), v);
        }
        Some(Value::Object(args))
    };
    match format {
        // `hf` and `beam` read the embedded model's response template, which says Hermes's text
        ToolCallFormat::Hermes | ToolCallFormat::Hf | ToolCallFormat::Beam => {
            json_call("<tool_call>\n", "arguments", "\n</tool_call>")
        }
        ToolCallFormat::Granite => json_call("<|tool_call|>[", "arguments", "]"),
        ToolCallFormat::Xlam => json_call("[", "arguments", "]"),
        ToolCallFormat::Phi4MiniJson => json_call("functools[", "arguments", "]"),
        ToolCallFormat::Internlm => json_call(
            "<|action_start|><|plugin|>\n",
            "parameters",
            "<|action_end|>",
        ),
        ToolCallFormat::Llama3Json => json_call("", "parameters", ""),
        ToolCallFormat::Mistral => {
            let (name, args) = t.strip_prefix("[TOOL_CALLS]")?.split_once("[ARGS]")?;
            Some((name.into(), serde_json::from_str(args).ok()?))
        }
        ToolCallFormat::DeepseekV3 => {
            let body = t.strip_prefix(
                "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>",
            )?;
            let (name, rest) = body.split_once("\n```json\n")?;
            let args = rest.strip_suffix("\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")?;
            Some((name.into(), serde_json::from_str(args).ok()?))
        }
        ToolCallFormat::KimiK2 => {
            let body =
                t.strip_prefix("<|tool_calls_section_begin|><|tool_call_begin|>functions.")?;
            let (name, rest) = body.split_once(":0<|tool_call_argument_begin|>")?;
            let args = rest.strip_suffix("<|tool_call_end|><|tool_calls_section_end|>")?;
            Some((name.into(), serde_json::from_str(args).ok()?))
        }
        ToolCallFormat::DeepseekV31 => {
            let body = t.strip_prefix("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>")?;
            let (name, rest) = body.split_once("<｜tool▁sep｜>")?;
            let args = rest.strip_suffix("<｜tool▁call▁end｜><｜tool▁calls▁end｜>")?;
            Some((name.into(), serde_json::from_str(args).ok()?))
        }
        ToolCallFormat::Longcat => json_call(
            "<longcat_tool_call>\n",
            "arguments",
            "\n</longcat_tool_call>",
        ),
        ToolCallFormat::HunyuanA13b | ToolCallFormat::Jamba => {
            json_call("<tool_calls>[", "arguments", "]</tool_calls>")
        }
        ToolCallFormat::Granite20bFc => json_call("<function_call> ", "arguments", ""),
        ToolCallFormat::Gigachat3 => json_call("<|function_call|>", "arguments", ""),
        ToolCallFormat::Apertus => {
            let body = t
                .strip_prefix("<|tools_prefix|>[")?
                .strip_suffix("]<|tools_suffix|>")?;
            let v: Value = serde_json::from_str(body).ok()?;
            let (name, args) = v.as_object()?.iter().next()?;
            Some((name.clone(), args.clone()))
        }
        ToolCallFormat::Pythonic | ToolCallFormat::Llama4Pythonic => {
            python_call(t.strip_prefix('[')?.strip_suffix(")]")?)
        }
        ToolCallFormat::Olmo3 => python_call(
            t.strip_prefix("<function_calls>")?
                .strip_suffix(")</function_calls>")?,
        ),
        ToolCallFormat::Lfm2 => python_call(
            t.strip_prefix("<|tool_call_start|>[")?
                .strip_suffix(")]<|tool_call_end|>")?,
        ),
        ToolCallFormat::FunctionGemma => {
            let body = t
                .strip_prefix("<start_function_call>call:")?
                .strip_suffix("}<end_function_call>")?;
            let (name, rest) = body.split_once('{')?;
            // a value may hold commas: the pairs are split where one ends and a key follows
            let rest = format!("\u{2}{rest}").replace("<escape>,", "<escape>\u{2}");
            Some((name.into(), pairs(&rest, "\u{2}", ":<escape>", "<escape>")?))
        }
        ToolCallFormat::Qwen3Xml | ToolCallFormat::Qwen3Coder | ToolCallFormat::SeedOss => {
            // Seed-OSS writes Qwen3-Coder's XML inside a tag of its own
            let wrapper = if format == ToolCallFormat::SeedOss {
                "seed:tool_call"
            } else {
                "tool_call"
            };
            let body = t.strip_prefix(&format!("<{wrapper}>\n<function="))?;
            let body = body.strip_suffix(&format!("</function>\n</{wrapper}>"))?;
            let (name, rest) = body.split_once(">\n")?;
            Some((
                name.into(),
                pairs(rest, "<parameter=", ">\n", "\n</parameter>")?,
            ))
        }
        ToolCallFormat::Mimo => {
            let body = t.strip_prefix("<tool_call><function=")?;
            let body = body.strip_suffix("</function></tool_call>")?;
            let (name, rest) = body.split_once('>')?;
            // the parser keeps line breaks: a value must have none to be read as written
            if rest.contains('\n') {
                return None;
            }
            Some((
                name.into(),
                pairs(rest, "<parameter=", ">", "</parameter>")?,
            ))
        }
        ToolCallFormat::MinimaxM2 | ToolCallFormat::Dots => {
            let (open, close) = if format == ToolCallFormat::Dots {
                ("<dots_function_call>\n", "</dots_function_call>")
            } else {
                ("<minimax:tool_call>\n", "</minimax:tool_call>")
            };
            let body = t.strip_prefix(open)?.strip_suffix(close)?;
            let body = body.strip_prefix("<invoke name=\"")?;
            let body = body.strip_suffix("</invoke>\n")?;
            let (name, rest) = body.split_once("\">\n")?;
            Some((
                name.into(),
                pairs(rest, "<parameter name=\"", "\">", "</parameter>")?,
            ))
        }
        ToolCallFormat::DeepseekV32 | ToolCallFormat::DeepseekV4 | ToolCallFormat::DeepseekV41 => {
            let (block, dsml) = match format {
                ToolCallFormat::DeepseekV32 => ("function_calls", "｜DSML｜"),
                ToolCallFormat::DeepseekV4 => ("tool_calls", "｜DSML｜"),
                _ => ("calls", "｜DSML｜ "),
            };
            let body = t
                .strip_prefix(&format!("<{dsml}{block}>\n<{dsml}invoke name=\""))?
                .strip_suffix(&format!("</{dsml}invoke>\n</{dsml}{block}>"))?;
            let (name, rest) = body.split_once("\">\n")?;
            // the parser's reading: a value under `string="true"` is the string itself,
            // any other is JSON
            let mut args = serde_json::Map::new();
            for part in rest.split(&format!("<{dsml}parameter name=\"")).skip(1) {
                let (head, after) = part.split_once('>')?;
                let (k, flag) = head.split_once("\" string=\"")?;
                let v = after.split(&format!("</{dsml}parameter>")).next()?;
                let v = match flag {
                    "true\"" => Value::String(v.into()),
                    _ => serde_json::from_str(v).ok()?,
                };
                args.insert(k.into(), v);
            }
            Some((name.into(), Value::Object(args)))
        }
        ToolCallFormat::Step3 => {
            let body = t.strip_prefix(
                "<｜tool_calls_begin｜><｜tool_call_begin｜>function<｜tool_sep｜><steptml:invoke name=\"",
            )?;
            let body =
                body.strip_suffix("</steptml:invoke><｜tool_call_end｜><｜tool_calls_end｜>")?;
            let (name, rest) = body.split_once("\">")?;
            Some((
                name.into(),
                pairs(
                    rest,
                    "<steptml:parameter name=\"",
                    "\">",
                    "</steptml:parameter>",
                )?,
            ))
        }
        ToolCallFormat::Muse | ToolCallFormat::MuseGlimmer => {
            let body = t
                .strip_prefix(" to=")?
                .strip_suffix("</atem:invoke>\n</atem:function_calls><|eom|>")?;
            let (to, rest) =
                body.split_once("<|message|><atem:function_calls>\n<atem:invoke name=\"")?;
            let (name, rest) = rest.split_once("\">\n")?;
            if to != name {
                return None;
            }
            // Muse keeps strings as written; Muse Glimmer reads every value as JSON
            let mut args = serde_json::Map::new();
            for part in rest.split("<atem:parameter name=\"").skip(1) {
                let (k, after) = part.split_once("\">")?;
                let v = after.split("</atem:parameter>").next()?;
                let v = match serde_json::from_str(v) {
                    Ok(Value::String(_)) if format == ToolCallFormat::Muse => {
                        Value::String(v.into())
                    }
                    Ok(v) => v,
                    Err(_) if format == ToolCallFormat::Muse => Value::String(v.into()),
                    Err(_) => return None,
                };
                args.insert(k.into(), v);
            }
            Some((name.into(), Value::Object(args)))
        }
        // (the test takes `<arg_value>` out of every answer before reading it)
        ToolCallFormat::HyV3 => {
            let body = t
                .strip_prefix("<tool_calls>\n<tool_call>")?
                .strip_suffix("</tool_call>\n</tool_calls>")?;
            let (name, rest) = body.split_once("<tool_sep>\n")?;
            let args = pairs(rest, "<arg_key>", "</arg_key>\n", "</arg_value>\n")?;
            Some((name.into(), args))
        }
        ToolCallFormat::HyV4 => {
            let body = t
                .strip_prefix("<tool_calls><tool_call>")?
                .strip_suffix("</tool_call></tool_calls>")?;
            let (name, rest) = body.split_at(body.find("<arg_key>")?);
            let args = pairs(rest, "<arg_key>", "</arg_key>", "</arg_value>")?;
            Some((name.into(), args))
        }
        ToolCallFormat::K2Horizon => {
            let body = t
                .strip_prefix("<ifm|tool_calls><ifm|tool_call>")?
                .strip_suffix("</ifm|tool_call></ifm|tool_calls>")?;
            let (name, rest) = body.split_at(body.find("<ifm|arg_key>")?);
            let args = pairs(
                rest,
                "<ifm|arg_key>",
                "</ifm|arg_key><ifm|arg_value>",
                "</ifm|arg_value>",
            )?;
            Some((name.into(), args))
        }
        ToolCallFormat::Minicpm5 => {
            let body = t
                .strip_prefix("<function name=\"")?
                .strip_suffix("</function>")?;
            let (name, rest) = body.split_once("\">")?;
            Some((
                name.into(),
                pairs(rest, "<param name=\"", "\">", "</param>")?,
            ))
        }
        ToolCallFormat::KimiK3 => {
            let body = t
                .strip_prefix("<|open|>tools<|sep|><|open|>call tool=\"")?
                .strip_suffix("<|close|>call<|sep|><|close|>tools<|sep|>")?;
            let (name, rest) = body.split_once("\" index=\"1\"<|sep|>")?;
            let mut args = serde_json::Map::new();
            // the type tells the parser how to read the value: raw text or JSON
            for part in rest.split("<|open|>argument key=\"").skip(1) {
                let (k, after) = part.split_once("\" type=\"")?;
                let (ty, after) = after.split_once("\"<|sep|>")?;
                let v = after.strip_suffix("<|close|>argument<|sep|>")?;
                let v = match ty {
                    "string" => Value::String(v.into()),
                    _ => serde_json::from_str(v).ok()?,
                };
                args.insert(k.into(), v);
            }
            Some((name.into(), Value::Object(args)))
        }
        ToolCallFormat::Openai => {
            let body = t
                .strip_prefix("<|channel|>commentary to=functions.")?
                .strip_suffix("<|call|>")?;
            let (name, args) = body.split_once(" <|constrain|>json<|message|>")?;
            Some((name.into(), serde_json::from_str(args).ok()?))
        }
        ToolCallFormat::CohereCommand3 | ToolCallFormat::CohereCommand4 => {
            let body = t
                .strip_prefix("<|START_ACTION|>")?
                .strip_suffix("<|END_ACTION|>")?;
            let calls: Value = serde_json::from_str(body).ok()?;
            let [call] = calls.as_array()?.as_slice() else {
                return None;
            };
            Some((
                call["tool_name"].as_str()?.into(),
                call["parameters"].clone(),
            ))
        }
        ToolCallFormat::Inkling => json_call(
            "<|message_model|><|content_invoke_tool_json|>",
            "args",
            "<|end_message|>",
        ),
        ToolCallFormat::Plamo3 => {
            let body = t
                .strip_prefix("<|plamo:begin_tool_requests:plamo|><|plamo:begin_tool_request:plamo|><|plamo:begin_tool_name:plamo|>")?
                .strip_suffix("<|plamo:end_tool_arguments:plamo|><|plamo:end_tool_request:plamo|><|plamo:end_tool_requests:plamo|>")?;
            let (name, args) = body.split_once(
                "<|plamo:end_tool_name:plamo|><|plamo:begin_tool_arguments:plamo|><|plamo:constrain|>json<|plamo:msg|>",
            )?;
            Some((name.into(), serde_json::from_str(args).ok()?))
        }
        ToolCallFormat::MinimaxM3 => {
            let body = t
                .strip_prefix("]<]minimax[>[<tool_call>\n]<]minimax[>[<invoke name=\"")?
                .strip_suffix("]<]minimax[>[</invoke>\n]<]minimax[>[</tool_call>")?;
            let (name, rest) = body.split_once("\">\n")?;
            Some((name.into(), m3_elements(rest)?))
        }
        ToolCallFormat::Gemma4 => {
            let body = t
                .strip_prefix("<|tool_call>call:")?
                .strip_suffix("<tool_call|>")?;
            let (name, rest) = body.split_at(body.find('{')?);
            let (args, rest) = gemma4_value(rest)?;
            rest.is_empty().then(|| (name.into(), args))
        }
        ToolCallFormat::Glm45 => {
            let body = t
                .strip_prefix("<tool_call>")?
                .strip_suffix("</tool_call>")?;
            let (name, rest) = body.split_once('\n')?;
            let rest = rest.replace("</arg_key>\n", "\u{1}");
            Some((
                name.into(),
                pairs(&rest, "<arg_key>", "\u{1}", "</arg_value>")?,
            ))
        }
    }
}

#[test]
fn every_tool_call_format_writes_the_tool_and_its_typed_arguments() {
    use clap::ValueEnum;
    for format in ToolCallFormat::value_variants().iter().copied() {
        let calls = ToolCalls { rate: 1.0, format };
        for seed in 0..4 {
            let g = calls.decide(&weather_tools(), seed).unwrap();
            // room for Step-3's call: its markers are 3 bytes a character, one token a byte
            let (t, end) = run(g, "f", 500);
            assert_eq!(end, End::Eos, "{format:?}: {t}");
            let t = t.replace("<arg_value>", "");
            let (name, args) =
                read_call(format, &t).unwrap_or_else(|| panic!("{format:?} unreadable: {t}"));
            assert_eq!(name, "get_weather", "{format:?}: {t}");
            assert!(
                args["city"].is_string() && args["days"].is_i64(),
                "{format:?}: {args} from {t}"
            );
            assert_eq!(ToolCallFormat::from_parser(format.parser()), Some(format));
        }
    }
    assert_eq!(
        ToolCallFormat::from_parser("glm47"),
        Some(ToolCallFormat::Glm45)
    );
    assert_eq!(
        ToolCallFormat::from_parser("llama4_json"),
        Some(ToolCallFormat::Llama3Json)
    );
    for (alias, format) in [
        ("ernie45", ToolCallFormat::Hermes),
        ("step3p5", ToolCallFormat::Qwen3Coder),
        ("step5", ToolCallFormat::Qwen3Coder),
        ("ling3", ToolCallFormat::Glm45),
        ("poolside_v1", ToolCallFormat::Glm45),
        ("musespark1x", ToolCallFormat::Muse),
    ] {
        assert_eq!(ToolCallFormat::from_parser(alias), Some(format), "{alias}");
    }
    assert_eq!(ToolCallFormat::from_parser("hf"), Some(ToolCallFormat::Hf));
    assert_eq!(
        ToolCallFormat::from_parser("beam"),
        Some(ToolCallFormat::Beam)
    );
    assert_eq!(ToolCallFormat::from_parser("no_such_parser"), None);
}

#[test]
fn gemma4_and_minimax_m3_calls_nest_objects_and_lists_in_their_own_syntax() {
    let tools = PromptTools {
        tools: vec![Tool {
            name: "plan".into(),
            parameters: json!({"type": "object", "properties": {
                "trip": {"type": "object", "properties": {
                    "city": {"type": "string"}, "nights": {"type": "integer"},
                    "stops": {"type": "array", "items": {"type": "string"}}},
                    "required": ["city", "nights", "stops"]},
                "fast": {"type": "boolean"},
                "unit": {"type": "string", "enum": ["C", "F"]}},
                "required": ["trip", "fast", "unit"]}),
        }],
        after_tool_result: false,
    };
    for (format, seed) in [ToolCallFormat::Gemma4, ToolCallFormat::MinimaxM3]
        .into_iter()
        .flat_map(|f| (0..4).map(move |seed| (f, seed)))
    {
        let calls = ToolCalls { rate: 1.0, format };
        let (t, end) = run(calls.decide(&tools, seed).unwrap(), "g", 600);
        assert_eq!(end, End::Eos, "{t}");
        let (name, args) = read_call(format, &t).unwrap_or_else(|| panic!("{t}"));
        assert_eq!(name, "plan");
        let trip = &args["trip"];
        assert!(
            trip["city"].is_string()
                && trip["nights"].is_i64()
                && trip["stops"]
                    .as_array()
                    .is_some_and(|s| s.iter().all(Value::is_string))
                && args["fast"].is_boolean()
                && ["C", "F"].contains(&args["unit"].as_str().unwrap_or("")),
            "{args} from {t}"
        );
    }
}

#[test]
fn xml_styled_arguments_of_a_required_call_are_spelled_per_parameter() {
    // what the frontends send for `required` with the qwen3_xml parser (the tool's
    // schema is the one the prompt shows, named by the tag's `begin`) and with glm45's
    for (style, begin, end) in [
        (
            "qwen_xml",
            "<tool_call>\n<function=get_weather>\n",
            "\n</function>\n</tool_call>",
        ),
        ("glm_xml", "<tool_call>get_weather\n", "</tool_call>"),
        // MiMo's tag: Qwen's XML without line breaks, values inline
        (
            "qwen_xml",
            "<tool_call><function=get_weather>",
            "</function></tool_call>",
        ),
        // DeepSeek-V3.2's tag: DSML parameters inside its `invoke`
        (
            "deepseek_xml",
            "<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n",
            "</｜DSML｜invoke>\n</｜DSML｜function_calls>",
        ),
        // DeepSeek-V4.1's tag: spaced DSML parameters inside its `invoke`
        (
            "deepseek_v4_1_xml",
            "<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"get_weather\">\n",
            "</｜DSML｜ invoke>\n</｜DSML｜ calls>",
        ),
        // MiniMax-M2's tag: `<invoke …>` inside its `<minimax:tool_call>` trigger
        (
            "minimax_xml",
            "<minimax:tool_call>\n<invoke name=\"get_weather\">\n",
            "</invoke>\n</minimax:tool_call>",
        ),
    ] {
        let tag = json!({"type": "structural_tag", "format": {"type": "triggered_tags",
            "triggers": [begin], "at_least_one": true, "stop_after_first": true,
            "tags": [{"type": "tag", "begin": begin, "end": end,
                "content": {"type": "json_schema", "json_schema": true, "style": style}}]}});
        let (t, end_kind) = run(tag_grammar(&tag, &weather_tools()), "x", 300);
        assert_eq!(end_kind, End::Eos, "{style}: {t}");
        let format = match style {
            "qwen_xml" if !begin.ends_with('\n') => ToolCallFormat::Mimo,
            "qwen_xml" => ToolCallFormat::Qwen3Xml,
            "minimax_xml" => ToolCallFormat::MinimaxM2,
            "deepseek_xml" => ToolCallFormat::DeepseekV32,
            "deepseek_v4_1_xml" => ToolCallFormat::DeepseekV41,
            _ => ToolCallFormat::Glm45,
        };
        let t = t
            .replace("<arg_value>", "")
            .replace("</parameter>\n\n</function>", "</parameter>\n</function>");
        let (name, args) = read_call(format, &t).unwrap_or_else(|| panic!("{style}: {t}"));
        assert_eq!(name, "get_weather");
        assert!(
            args["city"].is_string() && args["days"].is_i64(),
            "{style}: {t}"
        );
    }
}
