//! One syntax for every option that takes a time (`-d`, `--window`, `--off-cpu-min`,
//! `--flight-recorder`, `dump --last`, and the agent's config keys): a number with a unit
//! (`1500ms`, `5s`, `2m`, `1h`, or several, `1m30s`), or a plain number in the option's own
//! unit, so that every spelling that worked before still does.

use std::time::Duration;

/// What a plain number counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unit {
    Millis,
    Secs,
}

impl Unit {
    fn nanos(self) -> f64 {
        match self {
            Unit::Millis => 1e6,
            Unit::Secs => 1e9,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Unit::Millis => "milliseconds",
            Unit::Secs => "seconds",
        }
    }
}

/// Parses `s`; a plain number counts `plain`.
pub fn parse(s: &str, plain: Unit) -> Result<Duration, String> {
    let text = s.trim();
    let bad = || {
        format!(
            "invalid duration '{s}': a number of {} or one with a unit: ms, s, m or h (e.g. \
             1500ms, 5s, 2m, 1m30s)",
            plain.name()
        )
    };
    if text.is_empty() {
        return Err(bad());
    }
    let mut rest = text;
    let mut nanos = 0f64;
    let mut parts = 0;
    while !rest.is_empty() {
        let num_len = rest.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(rest.len());
        let (num, tail) = rest.split_at(num_len);
        let unit_len = tail.find(|c: char| !c.is_ascii_alphabetic()).unwrap_or(tail.len());
        let (unit, tail) = tail.split_at(unit_len);
        let value: f64 = num.parse().map_err(|_| bad())?;
        let scale = match unit {
            // A plain number only alone: "1m30" is a typo, not 90 s.
            "" if parts == 0 && tail.is_empty() => plain.nanos(),
            "ms" => 1e6,
            "s" => 1e9,
            "m" => 60e9,
            "h" => 3600e9,
            _ => return Err(bad()),
        };
        nanos += value * scale;
        parts += 1;
        rest = tail.trim_start();
    }
    if !nanos.is_finite() || nanos > u64::MAX as f64 {
        return Err(format!("invalid duration '{s}': too long"));
    }
    Ok(Duration::from_nanos(nanos.round() as u64))
}

/// Clap's parser for an option counted in seconds.
pub fn secs(s: &str) -> Result<Duration, String> {
    parse(s, Unit::Secs)
}

/// Clap's parser for an option counted in milliseconds.
pub fn millis(s: &str) -> Result<Duration, String> {
    parse(s, Unit::Millis)
}

/// A config file's time: a TOML number in the key's unit, or a string as on the command line.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ConfigDuration(pub Duration);

#[derive(serde::Deserialize)]
#[serde(untagged)]
enum Raw {
    Number(f64),
    Text(String),
}

impl ConfigDuration {
    fn read<'de, D: serde::Deserializer<'de>>(d: D, unit: Unit) -> Result<Option<Self>, D::Error> {
        let raw: Option<Raw> = serde::Deserialize::deserialize(d)?;
        let text = match raw {
            None => return Ok(None),
            Some(Raw::Number(n)) => n.to_string(),
            Some(Raw::Text(t)) => t,
        };
        parse(&text, unit).map(|d| Some(Self(d))).map_err(serde::de::Error::custom)
    }

    /// `deserialize_with` for a key counted in seconds.
    pub fn secs<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Self>, D::Error> {
        Self::read(d, Unit::Secs)
    }

    /// `deserialize_with` for a key counted in milliseconds.
    pub fn millis<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Self>, D::Error> {
        Self::read(d, Unit::Millis)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_and_plain_numbers() {
        assert_eq!(secs("5"), Ok(Duration::from_secs(5)));
        assert_eq!(secs("5s"), Ok(Duration::from_secs(5)));
        assert_eq!(secs("1.5"), Ok(Duration::from_millis(1500)));
        assert_eq!(secs("1500ms"), Ok(Duration::from_millis(1500)));
        assert_eq!(secs("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(secs("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(secs("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(secs("1m 30s"), Ok(Duration::from_secs(90)));
        assert_eq!(secs(" 10s "), Ok(Duration::from_secs(10)));
        assert_eq!(millis("5"), Ok(Duration::from_millis(5)));
        assert_eq!(millis("0.5"), Ok(Duration::from_micros(500)));
        assert_eq!(millis("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(secs("0"), Ok(Duration::ZERO));
    }

    #[test]
    fn bad_units_are_one_line_errors() {
        for bad in ["5x", "", "s", "-5s", "5 sec", "1m30", "5ss", "1e3", "nan", "5.5.5s", "1d"] {
            let e = secs(bad).expect_err(bad);
            assert!(e.starts_with(&format!("invalid duration '{bad}'")), "{e}");
            assert!(!e.contains('\n'), "{e}");
        }
        assert!(millis("x").unwrap_err().contains("milliseconds"));
        assert!(secs("99999999999999999h").unwrap_err().contains("too long"));
    }

    #[test]
    fn config_values() {
        #[derive(serde::Deserialize)]
        struct C {
            #[serde(default, deserialize_with = "ConfigDuration::secs")]
            window: Option<ConfigDuration>,
            #[serde(default, deserialize_with = "ConfigDuration::millis")]
            min: Option<ConfigDuration>,
        }
        let c: C = toml::from_str("window = \"10s\"\nmin = 5\n").unwrap();
        assert_eq!(c.window, Some(ConfigDuration(Duration::from_secs(10))));
        assert_eq!(c.min, Some(ConfigDuration(Duration::from_millis(5))));
        let c: C = toml::from_str("window = 2.5").unwrap();
        assert_eq!(c.window, Some(ConfigDuration(Duration::from_millis(2500))));
        let c: C = toml::from_str("").unwrap();
        assert_eq!(c.window, None);
        let e = toml::from_str::<C>("window = \"10y\"").err().unwrap().to_string();
        assert!(e.contains("invalid duration '10y'"), "{e}");
    }
}
