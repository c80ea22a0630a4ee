//! Sizes as people write them (`512M`, `10G`, `10%`) and as they read them (`1.5 GiB`):
//! flags, the config file, logs and tables all use these. Reading is our own: a suffix
//! is binary (`512M` is 512 MiB, as for ulimit and systemd) and a size may be a
//! percentage, which no size crate reads that way; writing is bytesize's.

use std::str::FromStr;

/// A size in bytes, or a share of something (RAM: MemTotal).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Size {
    Bytes(u64),
    Percent(f64),
}

impl FromStr for Size {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let t = s.trim();
        if let Some(p) = t.strip_suffix('%') {
            let v: f64 = p
                .trim()
                .parse()
                .map_err(|_| format!("{s:?} is not a percentage"))?;
            if !(0.0..=100.0).contains(&v) {
                return Err(format!("{s:?}: a percentage is between 0 and 100"));
            }
            return Ok(Size::Percent(v));
        }
        let upper = t.to_ascii_uppercase();
        let digits = upper.trim_end_matches(|c: char| c.is_ascii_alphabetic());
        let unit = upper[digits.len()..]
            .trim_end_matches("IB")
            .trim_end_matches('B');
        if digits.trim().is_empty() {
            return Err(format!("{s:?} is not a size (e.g. 512M, 10G, 10%)"));
        }
        let factor: u64 = match unit {
            "" => 1,
            "K" => 1 << 10,
            "M" => 1 << 20,
            "G" => 1 << 30,
            "T" => 1 << 40,
            _ => return Err(format!("{s:?}: unknown unit (use K, M, G, T or %)")),
        };
        let v: f64 = digits
            .trim()
            .parse()
            .map_err(|_| format!("{s:?} is not a size (e.g. 512M, 10G, 10%)"))?;
        if v < 0.0 {
            return Err(format!("{s:?}: a size is not negative"));
        }
        Ok(Size::Bytes((v * factor as f64) as u64))
    }
}

impl std::fmt::Display for Size {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            Size::Percent(p) => write!(f, "{p}%"),
            Size::Bytes(b) => {
                let unit = [(40, "T"), (30, "G"), (20, "M"), (10, "K")]
                    .into_iter()
                    .find(|(shift, _)| b != 0 && b % (1u64 << shift) == 0);
                match unit {
                    Some((shift, u)) => write!(f, "{}{u}", b >> shift),
                    None => write!(f, "{b}"),
                }
            }
        }
    }
}

/// In a config file: a string as on the command line, or a number of bytes.
impl<'de> serde::Deserialize<'de> for Size {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = Size;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a size such as \"512M\", \"10G\" or \"10%\", or a number of bytes")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Size, E> {
                Ok(Size::Bytes(v))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Size, E> {
                u64::try_from(v)
                    .map(Size::Bytes)
                    .map_err(|_| E::custom("a size is not negative"))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Size, E> {
                v.parse().map_err(E::custom)
            }
        }
        d.deserialize_any(Visitor)
    }
}

impl serde::Serialize for Size {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl Size {
    /// Bytes, a percentage being of `whole`.
    pub fn of(self, whole: u64) -> u64 {
        match self {
            Size::Bytes(b) => b,
            Size::Percent(p) => (whole as f64 * p / 100.0) as u64,
        }
    }
}

/// Formats bytes for people, in binary units: `12 B`, `1.5 KiB`, `5.0 GiB`.
pub fn human(n: u64) -> String {
    bytesize::ByteSize::b(n).display().iec().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_sizes_as_people_write_them() {
        assert_eq!("512M".parse(), Ok(Size::Bytes(512 << 20)));
        assert_eq!("10G".parse(), Ok(Size::Bytes(10 << 30)));
        assert_eq!("10GiB".parse(), Ok(Size::Bytes(10 << 30)));
        assert_eq!("1.5k".parse(), Ok(Size::Bytes(1536)));
        assert_eq!("4096".parse(), Ok(Size::Bytes(4096)));
        assert_eq!("10%".parse(), Ok(Size::Percent(10.0)));
        assert!("10X".parse::<Size>().is_err());
        assert!("ten".parse::<Size>().is_err());
        assert!("150%".parse::<Size>().is_err());
        assert_eq!(Size::Percent(10.0).of(1000), 100);
        assert_eq!(Size::Bytes(7).of(1000), 7);
    }

    #[test]
    fn formats_bytes() {
        assert_eq!(human(12), "12 B");
        assert_eq!(human(1536), "1.5 KiB");
        assert_eq!(human(5 << 30), "5.0 GiB");
    }
}
