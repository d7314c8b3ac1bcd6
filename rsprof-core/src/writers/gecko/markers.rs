//! Marker schemas and payloads as Gecko JSON (`meta.markerSchema`, `data` of marker rows).

use std::collections::HashMap;

use serde_json::{Map, Value, json};

use crate::model::markers::{FieldFormat, MarkerSchema, MarkerValue, MarkerView};

/// `{name}` → `{marker.name}`, `{KEY}` → `{marker.data.KEY}`: the front-end's template syntax.
fn template(t: &str) -> String {
    let mut out = String::with_capacity(t.len() + 16);
    let mut rest = t;
    while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        let Some(close) = rest[open..].find('}') else { break };
        let key = &rest[open + 1..open + close];
        out.push_str(&if key == "name" {
            "{marker.name}".to_owned()
        } else {
            format!("{{marker.data.{key}}}")
        });
        rest = &rest[open + close + 1..];
    }
    out.push_str(rest);
    out
}

pub fn schema_json(s: &MarkerSchema) -> Value {
    let views: Vec<&str> = s
        .views
        .iter()
        .map(|v| match v {
            MarkerView::Chart => "marker-chart",
            MarkerView::Table => "marker-table",
            MarkerView::Timeline => "timeline-overview",
        })
        .collect();
    let mut data: Vec<Value> = s
        .fields
        .iter()
        .map(|f| {
            let format = match f.format {
                FieldFormat::String => "string",
                FieldFormat::Integer => "integer",
            };
            let mut v = json!({"key": f.key, "label": f.label, "format": format});
            if f.searchable {
                v["searchable"] = json!(true);
            }
            v
        })
        .collect();
    data.extend(s.notes.iter().map(|(label, value)| json!({"label": label, "value": value})));
    let mut out = json!({"name": s.name, "display": views, "data": data});
    for (key, t) in [
        ("chartLabel", &s.chart_label),
        ("tableLabel", &s.table_label),
        ("tooltipLabel", &s.tooltip_label),
    ] {
        if let Some(t) = t {
            out[key] = json!(template(t));
        }
    }
    if let Some(d) = &s.description {
        out["description"] = json!(d);
    }
    if !s.graphs.is_empty() {
        out["graphs"] =
            s.graphs.iter().map(|k| json!({"key": k, "type": "line", "color": "blue"})).collect();
    }
    out
}

/// Field keys of each schema, in stored order: stored marker fields are positional.
pub fn field_keys(schemas: &[MarkerSchema]) -> HashMap<String, Vec<String>> {
    schemas.iter().map(|s| (s.name.clone(), s.keys().map(str::to_owned).collect())).collect()
}

/// The payload of a marker of `schema`; `fields` are named by the schema's keys (an unknown
/// schema's fields by position, `f0`…), and a None field is left out.
pub fn payload(
    keys: &HashMap<String, Vec<String>>,
    schema: &str,
    fields: &[Option<MarkerValue>],
) -> Value {
    let mut data = Map::new();
    data.insert("type".into(), schema.into());
    let schema_keys = keys.get(schema);
    for (i, v) in fields.iter().enumerate() {
        let Some(v) = v else { continue };
        let key = schema_keys.and_then(|k| k.get(i)).cloned().unwrap_or_else(|| format!("f{i}"));
        let v = match v {
            MarkerValue::Str(s) => Value::from(s.as_str()),
            MarkerValue::Int(v) => Value::from(*v),
            MarkerValue::Uint(v) => Value::from(*v),
        };
        data.insert(key, v);
    }
    Value::Object(data)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::markers::{MarkerSource, SchemaField};

    #[test]
    fn templates_name_the_marker_and_its_data() {
        assert_eq!(template("{name}: {text}"), "{marker.name}: {marker.data.text}");
        assert_eq!(template("plain"), "plain");
        assert_eq!(template("{arg0} {arg1}"), "{marker.data.arg0} {marker.data.arg1}");
    }

    #[test]
    fn schema_and_payload() {
        let mut s = MarkerSchema::new("S", MarkerSource::Usdt, &[MarkerView::Chart]);
        s.fields = vec![SchemaField::new("n", "N", FieldFormat::Integer)];
        s.notes = vec![("Source".into(), "probe".into())];
        s.graphs = vec!["n".into()];
        let j = schema_json(&s);
        assert_eq!(j["display"], json!(["marker-chart"]));
        assert_eq!(j["data"][0], json!({"key": "n", "label": "N", "format": "integer"}));
        assert_eq!(j["data"][1], json!({"label": "Source", "value": "probe"}));
        assert_eq!(j["graphs"][0]["key"], "n");
        let keys = field_keys(&[s]);
        let p = payload(&keys, "S", &[Some(MarkerValue::Int(-3)), Some(MarkerValue::Uint(4))]);
        assert_eq!(p, json!({"type": "S", "n": -3, "f1": 4}));
        assert_eq!(payload(&keys, "S", &[None]), json!({"type": "S"}));
    }
}
